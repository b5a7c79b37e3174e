"""Pure-torch CPU fallbacks for FLA 0.6.0 (whose ops are Triton-only).

:func:`enable_cpu_fallbacks` (idempotent) replaces FLA's Triton entry points by device dispatchers:
CPU tensors take flame's torch code, any other device calls the original FLA function unchanged.
``import flame`` does not call it; the code paths that run FLA models on CPU do (the trainer's setup
through :func:`prepare_model_build`, ``flame.generate``, the offload planner's meta measurements).

Covered model families (forward + backward, float32 and bfloat16, tested in tests/models):
``gla, delta_net, gated_deltanet, gsa, hgrn2, mamba, mamba2, samba``. Mamba and Mamba2 layers run
FLA's torch paths with flame's chunked scans in place of FLA's (``flame.models.fla_mamba``, on
every device when mamba_ssm is absent); they need only the norms and the conv from this package.
Not covered: ``reverse=True`` recurrences, value-dim gates in the delta rule, vocab-parallel and
context-parallel kernels, FLA's ``use_attnres`` (``fused_attnres``), and FLA families whose layers use
other Triton ops than the ones listed in ``FUNCTION_PATCHES`` (they still fail on CPU with
Triton's "0 active drivers" error).
"""
from __future__ import annotations

import contextlib
import importlib

from flame.models.cpu import modules as M
from flame.models.cpu import ops as O
from flame.models.cpu.patch import MARK, patch_functions_everywhere, patch_method, unpatch_everywhere, unpatch_method
from flame.models.fla_mamba import install_chunked_scans

CPU_FAMILIES = ('gla', 'delta_net', 'gated_deltanet', 'gsa', 'hgrn2', 'mamba', 'mamba2', 'samba')

# (module that defines the name, name, torch implementation)
FUNCTION_PATCHES = [
    ('fla.ops.gla', 'chunk_gla', O.chunk_gla_cpu),
    ('fla.ops.gla', 'fused_recurrent_gla', O.fused_recurrent_gla_cpu),
    ('fla.ops.gla', 'fused_chunk_gla', O.fused_chunk_gla_cpu),
    ('fla.ops.delta_rule', 'chunk_delta_rule', O.delta_rule_cpu),
    ('fla.ops.delta_rule', 'fused_recurrent_delta_rule', O.delta_rule_cpu),
    ('fla.ops.gated_delta_rule', 'chunk_gated_delta_rule', O.delta_rule_cpu),
    ('fla.ops.gated_delta_rule', 'fused_recurrent_gated_delta_rule', O.delta_rule_cpu),
    ('fla.ops.gsa', 'chunk_gsa', O.gsa_cpu),
    ('fla.ops.gsa', 'fused_recurrent_gsa', O.gsa_cpu),
    ('fla.modules.norm.layernorm', 'layer_norm', M.layer_norm_cpu),
    ('fla.modules.norm.layernorm', 'rms_norm', M.rms_norm_cpu),
    ('fla.modules.norm.layernorm', 'group_norm', M.group_norm_cpu),
    ('fla.modules.norm.layernorm', 'layer_norm_linear', M.layer_norm_linear_cpu),
    ('fla.modules.norm.layernorm', 'rms_norm_linear', M.rms_norm_linear_cpu),
    ('fla.modules.norm.fused_norm_gate', 'layer_norm_gated', M.layer_norm_gated_cpu),
    ('fla.modules.norm.fused_norm_gate', 'rms_norm_gated', M.rms_norm_gated_cpu),
    ('fla.modules.norm.fused_norm_gate', 'layer_norm_swish_gate_linear', M.layer_norm_swish_gate_linear_cpu),
    ('fla.modules.norm.fused_norm_gate', 'rms_norm_swish_gate_linear', M.rms_norm_swish_gate_linear_cpu),
    ('fla.modules.norm.layernorm_gated', 'layernorm_fn', M.layernorm_fn_cpu),
    ('fla.modules.norm.layernorm_gated', 'rmsnorm_fn', M.rmsnorm_fn_cpu),
    ('fla.modules.norm.l2norm', 'l2norm', M.l2norm_cpu),
    ('fla.modules.causal_conv1d.ops', 'causal_conv1d', M.causal_conv1d_cpu),
    ('fla.modules.causal_conv1d.ops', 'causal_conv1d_update', M.causal_conv1d_update_cpu),
    ('fla.modules.rotary.ops', 'rotary_embedding', M.rotary_embedding_cpu),
] + [('fla.modules.activations.ops', name, fn) for name, fn in M.ACTIVATIONS_CPU.items()]

_state = {'enabled': False}


def enable_cpu_fallbacks(model=None) -> dict:
    """Install the CPU dispatchers into FLA (idempotent; safe to call from every rank).

    Imports ``fla`` (and thereby all its layers and models) first, so every ``from ... import``
    alias already exists when the names are rebound. FLA layers copy some functions into their
    instances at construction (``self.gate_fn = ACT2FN[...]``): pass ``model`` when it was built
    before this call and its instances are rebound too. Returns ``{name: bindings replaced}``, which
    is empty on repeated calls that had nothing new to patch.
    """
    import fla  # noqa: F401  (registers FLA models and imports every layer module)

    report = patch_functions_everywhere(FUNCTION_PATCHES, model)

    from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss
    from fla.modules.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
    patch_method(FusedCrossEntropyLoss, 'forward', M.fused_cross_entropy_forward_cpu)
    patch_method(FusedLinearCrossEntropyLoss, 'forward', M.fused_linear_cross_entropy_forward_cpu)

    install_attention_standins()
    install_chunked_scans()
    _state['enabled'] = True
    return report


def install_attention_standins() -> bool:
    """Hybrids (samba, attn layers in FLA configs) need flash-attn at construction time. When it is
    absent (it cannot be installed on the CPU CI machines nor on the lent GPU image), give
    fla.layers.attn stand-ins: SDPA with an explicit mask on CPU, FlexAttention (causal, sliding
    window, documents) on GPU. Returns True when the stand-ins are (now) in place. Idempotent."""
    attn = importlib.import_module('fla.layers.attn')
    if getattr(attn, 'flash_attn_func', None) is None:
        attn.flash_attn_func = M.flash_attn_func_cpu
        attn.flash_attn_varlen_func = M.flash_attn_varlen_func_cpu
    return attn.flash_attn_func is M.flash_attn_func_cpu


def prepare_model_build(device_type: str) -> None:
    """What building an FLA model needs before its constructors run: the flash-attn stand-ins
    (hybrid layers check for flash-attn at construction), flame's chunked Mamba/Mamba2 scans when
    mamba_ssm is absent and, for a model that will run on CPU, the CPU dispatchers (layers bind
    some functions at construction)."""
    if device_type == 'cpu':
        enable_cpu_fallbacks()
    else:
        install_attention_standins()
        install_chunked_scans()


def cpu_fallbacks_enabled() -> bool:
    return _state['enabled']


def disable_cpu_fallbacks() -> None:
    """Undo enable_cpu_fallbacks: every rebound name and registry entry back to FLA's original
    (the flash-attn stand-ins stay: flash-attn is absent either way)."""
    unpatch_everywhere()
    from fla.modules.fused_cross_entropy import FusedCrossEntropyLoss
    from fla.modules.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
    unpatch_method(FusedCrossEntropyLoss, 'forward')
    unpatch_method(FusedLinearCrossEntropyLoss, 'forward')
    _state['enabled'] = False


@contextlib.contextmanager
def cpu_fallbacks():
    """The dispatchers for the duration of the block only (left in place if they were on before):
    lets the offload planner run FLA models on the meta device during a GPU run without changing
    what the run's own model calls."""
    was = _state['enabled']
    enable_cpu_fallbacks()
    try:
        yield
    finally:
        if not was:
            disable_cpu_fallbacks()


__all__ = ['CPU_FAMILIES', 'FUNCTION_PATCHES', 'MARK', 'cpu_fallbacks', 'cpu_fallbacks_enabled', 'disable_cpu_fallbacks',
           'enable_cpu_fallbacks', 'install_attention_standins', 'prepare_model_build']
