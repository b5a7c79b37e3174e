"""FLA's Mamba and Mamba2 layers on flame's chunked torch scans when mamba_ssm is absent.

Without mamba_ssm, FLA 0.6 runs these layers (and Samba's Mamba mixers) on its pure-torch paths:
Mamba's ``slow_forward`` steps through time in a Python loop (one step per token), and Mamba2's
``torch_forward`` forms its within-chunk C.B product by a broadcast multiply and sum, building a
(batch, chunks, L, L, heads, state) tensor. :func:`install_chunked_scans` replaces both methods,
for the full-sequence forward (training and prefill, with or without a cache), by the same layer
computation around flame's scans (:mod:`flame.models.ssm_scan`). Single-token decoding with a
cache keeps FLA's own step.

Differences from FLA's torch paths, all toward mamba_ssm's kernels: time steps, the D skip and the
gate are computed in float32 (float64 for a float64 model), where FLA's Mamba path reads its states
out in the input dtype and both paths cast some inputs to float32 even in a float64 model. In
float32 the outputs equal FLA's up to rounding (tests/models/test_ssm_scan.py).
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from flame.models.ssm_scan import selective_scan, ssd_scan

logger = logging.getLogger(__name__)

MARK = '__flame_fla_original__'


def mamba_sequence_forward(self, input_states, use_cache=False, attention_mask=None):
    """``fla.layers.mamba.Mamba.slow_forward`` without a cached state, on the chunked scan."""
    seq_len, dtype = input_states.shape[1], input_states.dtype
    hidden_states, gate = self.in_proj(input_states).transpose(1, 2).chunk(2, dim=1)
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask.unsqueeze(1)
    conv_state = self._build_conv_state(hidden_states) if use_cache else None
    hidden_states = self.act(self.conv1d(hidden_states)[..., :seq_len])
    if attention_mask is not None:
        hidden_states = hidden_states * attention_mask.unsqueeze(1)

    time_step, B, C = torch.split(self.x_proj(hidden_states.transpose(1, 2)),
                                  [self.dt_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    wide = torch.promote_types(dtype, torch.float32)
    dt = F.softplus(self.dt_proj(time_step).to(wide)).transpose(1, 2)
    A = -torch.exp(self.A_log.to(wide))
    y, ssm_state = selective_scan(hidden_states, dt, A, B, C)
    y = y + hidden_states.to(wide) * self.D.to(wide)[None, :, None]
    y = y * self.act(gate.to(wide))
    return self.out_proj(y.to(dtype).transpose(1, 2)), conv_state, ssm_state


def mamba2_sequence_forward(self, input_states, use_cache=False, attention_mask=None):
    """``fla.layers.mamba2.Mamba2.torch_forward`` without a cached state, on the chunked SSD."""
    from fla.layers.mamba2 import apply_mask_to_padding_states

    batch, seq_len, _ = input_states.shape
    dtype = input_states.dtype
    projected = self.in_proj(input_states)
    groups_state = self.n_groups * self.ssm_state_size
    d_mlp = (projected.shape[-1] - 2 * self.intermediate_size - 2 * groups_state - self.num_heads) // 2
    _, _, gate, xBC, dt = projected.split([d_mlp, d_mlp, self.intermediate_size, self.conv_dim, self.num_heads],
                                          dim=-1)
    xBC = apply_mask_to_padding_states(xBC, attention_mask)
    conv_state = None
    if use_cache:
        # the last conv_kernel inputs, left-padded with zeros when the sequence is shorter
        conv_state = F.pad(xBC.transpose(1, 2), (self.conv_kernel_size - seq_len, 0))
    xBC = self.act(self.conv1d(xBC.transpose(1, 2))[..., :seq_len].transpose(1, 2))
    xBC = apply_mask_to_padding_states(xBC, attention_mask)
    x, B, C = torch.split(xBC, [self.intermediate_size, groups_state, groups_state], dim=-1)

    wide = torch.promote_types(dtype, torch.float32)
    dt = F.softplus(dt.to(wide) + self.dt_bias.to(wide)).clamp(self.dt_limit[0], self.dt_limit[1])
    x = x.reshape(batch, seq_len, self.num_heads, self.head_dim)
    y, ssm_state = ssd_scan(x, dt, -torch.exp(self.A_log.to(wide)),
                            B.reshape(batch, seq_len, self.n_groups, self.ssm_state_size),
                            C.reshape(batch, seq_len, self.n_groups, self.ssm_state_size), self.chunk_size)
    y = (y + x.to(wide) * self._get_D(expand_to_head_dim=True).to(wide)).reshape(batch, seq_len, -1)
    y = self.norm(y, gate) if self.rmsnorm else y * self.act(gate)
    return self.out_proj(y.to(dtype)), conv_state, ssm_state


def _chunked(original, sequence_forward):
    """FLA's torch-path method with full-sequence calls sent to ``sequence_forward``."""
    @functools.wraps(original)
    def forward(self, input_states, last_state=None, use_cache=False, attention_mask=None, **kwargs):
        if last_state is not None:  # single-token decoding
            return original(self, input_states, last_state, use_cache, attention_mask, **kwargs)
        return sequence_forward(self, input_states, use_cache, attention_mask)

    setattr(forward, MARK, original)
    return forward


def _targets():
    import fla.layers.mamba as mamba
    import fla.layers.mamba2 as mamba2

    return [(mamba, mamba.Mamba, 'slow_forward', mamba_sequence_forward),
            (mamba2, mamba2.Mamba2, 'torch_forward', mamba2_sequence_forward)]


def install_chunked_scans() -> list[str]:
    """Replace the torch-path methods of FLA's Mamba and Mamba2 layers whose mamba_ssm fast path is
    unavailable (FLA's ``is_fast_path_available``). Idempotent; logs once when it installs. Returns
    the layer classes installed by this call."""
    installed = []
    for module, cls, name, sequence_forward in _targets():
        current = cls.__dict__[name]
        if module.is_fast_path_available or hasattr(current, MARK):
            continue
        setattr(cls, name, _chunked(current, sequence_forward))
        installed.append(cls.__name__)
    if installed:
        logger.debug("%s: mamba_ssm absent; flame's chunked torch scans (flame/models/ssm_scan.py)",
                    "/".join(installed))
    return installed


def uninstall_chunked_scans() -> None:
    """FLA's own methods back (tests compare the two)."""
    for _, cls, name, _ in _targets():
        current = cls.__dict__[name]
        if hasattr(current, MARK):
            setattr(cls, name, getattr(current, MARK))
