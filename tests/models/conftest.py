"""Shared fixtures for tests/models: repo root on sys.path, CPU fallbacks, tiny configs."""
import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings('ignore', message='.*Triton is not supported.*')

DEBUG_DIR = os.path.join(ROOT, 'configs', 'debug')
FLA_FAMILIES = ('gla', 'delta_net', 'gated_deltanet', 'gsa', 'hgrn2', 'mamba', 'mamba2', 'samba')


@pytest.fixture(scope='session')
def cpu_fallbacks():
    from flame.models.fla_cpu import enable_cpu_fallbacks
    enable_cpu_fallbacks()
    return True


def debug_config(name):
    import fla  # noqa: F401
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, f'{name}.json'))
