"""``import flame`` registers model types and changes nothing else: FLA's functions, Triton's
autotuner and flash-attn's place stay as they were, and no environment variable can make it raise."""
import os
import subprocess
import sys

from models_testlib import ROOT

CHECK = '''
import importlib
import flame
import fla.layers.attn
from triton.runtime.autotuner import Autotuner
from transformers import AutoConfig
from flame.models.cpu import FUNCTION_PATCHES, MARK
patched = [f"{mod}.{name}" for mod, name, _ in FUNCTION_PATCHES if hasattr(getattr(importlib.import_module(mod), name), MARK)]
from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss
if hasattr(FusedCrossEntropyLoss.__dict__["forward"], MARK):
    patched.append("FusedCrossEntropyLoss.forward")
if fla.layers.attn.flash_attn_func is not None:
    patched.append("fla.layers.attn.flash_attn_func")
if hasattr(Autotuner.prune_configs, "_flame_base"):
    patched.append("Autotuner.prune_configs")
AutoConfig.for_model("transformer")  # flame's family is registered
print("PATCHED", patched)
'''


def test_import_flame_patches_nothing_and_ignores_a_bad_autotune_variable():
    env = dict(os.environ, FLAME_AUTOTUNE_MAX_CONFIGS='not-a-number')
    proc = subprocess.run([sys.executable, '-c', CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'PATCHED []' in proc.stdout, proc.stdout


def test_import_flame_on_cpu_prints_no_triton_warning_and_keeps_the_warning_filters():
    """FLA's "Triton is not supported ... roll back to CPU" is silenced around flame's import of FLA
    only: the process's warning filters are the same before and after ``import flame``."""
    code = ("import warnings; before = list(warnings.filters); import flame; "
            "print('FILTERS_KEPT', list(warnings.filters) == before)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='')
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'Triton is not supported' not in proc.stderr, proc.stderr
    assert 'FILTERS_KEPT True' in proc.stdout, proc.stdout
