"""Chunked pure-torch scans for Mamba's selective SSM and Mamba2's SSD (training without mamba_ssm).

Both compute in float32 whatever the (narrower) input dtype, in float64 for float64 inputs, with
autocast off (einsum would otherwise run in the autocast dtype), start from a zero state, and
return the output and the final state in that dtype.

``selective_scan`` (Mamba): per channel and state entry, h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t and
y_t = C_t . h_t. Time is split into chunks of length L (about sqrt(T)); the recurrence runs for all
chunks at once from a zero state (L Python steps), then the chunk-start states are carried chunk by
chunk (T / L steps) and each position adds C_t . (decay since its chunk start * chunk-start state).
Decays enter only as products of factors <= 1 (exponentials of cumulative sums of dt A <= 0), never
divided by. A step-per-token loop needs T Python steps; this one about 2 sqrt(T).

``ssd_scan`` (Mamba2): one decay per head, so the within-chunk part is a masked (L, L) matrix per
head and chunk, applied with matmuls (einsum): C.B per group, then the values; the chunk states,
the inter-chunk recurrence (a (chunks+1)^2 decay matrix per head) and the state-to-output term are
matmuls too. The largest intermediates are (batch, chunks, heads, L, L) and
(batch, chunks, heads, head_dim, state); nothing of size (L, L, heads, state) is built.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


def default_chunk_len(seq_len: int) -> int:
    """The chunk length that about minimizes the Python steps (L + T / L) of ``selective_scan``."""
    return max(1, round(math.sqrt(seq_len)))


def _autocast_off(device_type: str):
    """Autocast disabled on ``device_type``; nothing to disable where autocast does not exist (the
    meta device, on which the offload planner runs models)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _compute_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in float32, or float64 when any of them is."""
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return [t.to(dtype) for t in tensors]


def _pad_time(t: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """``t`` with ``pad`` zeros appended along ``dim`` (zero dt and inputs leave a state unchanged)."""
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's selective scan without the D skip and the gate.

    x, dt: (batch, channels, T), dt already positive (after softplus); A: (channels, state), <= 0;
    B, C: (batch, T, state). Returns y (batch, channels, T) and the state after the last position
    (batch, channels, state), in the compute dtype.
    """
    with _autocast_off(x.device.type):
        return _selective_scan(*_compute_dtype(x, dt, A, B, C), chunk_len)


def _selective_scan(x, dt, A, B, C, chunk_len):
    batch, channels, seq_len = x.shape
    L = chunk_len or default_chunk_len(seq_len)
    chunks = -(-seq_len // L)
    pad = chunks * L - seq_len

    # layout (L, chunks, batch, channels[, state]): the steps of both loops are contiguous leading
    # slices (unbind), whose gradients autograd stacks once instead of scattering into a
    # full-size zero tensor per step
    def steps_first(t, time_dim):  # (batch, [channels,] T, ...) -> (L, chunks, batch, ...)
        t = _pad_time(t, time_dim, pad)
        t = t.unflatten(time_dim, (chunks, L))
        return t.movedim((time_dim + 1, time_dim), (0, 1)).contiguous()

    dt, x = steps_first(dt, 2), steps_first(x, 2)  # (L, chunks, batch, channels)
    B, C = (steps_first(t, 1)[:, :, :, None] for t in (B, C))  # (L, chunks, batch, 1, state)

    # 1. every chunk from a zero state, all chunks at once; each step's decay and input are formed
    # inside the step, so no (time, channels, state) tensor of them (or of their gradients) exists
    state = x.new_zeros(chunks, batch, channels, A.shape[-1])
    outputs = []
    for dt_t, x_t, B_t, C_t in zip(dt.unbind(0), x.unbind(0), B.unbind(0), C.unbind(0)):
        state = torch.addcmul((dt_t * x_t)[..., None] * B_t, (dt_t[..., None] * A).exp(), state)
        outputs.append((state * C_t).sum(-1))
    y = torch.stack(outputs)  # (L, chunks, batch, channels)

    # the product of each chunk's decays up to each step (A does not depend on t: the running sum
    # of dt A is the running sum of dt times A), all factors <= 1
    decay_since_start = (dt.cumsum(dim=0)[..., None] * A).exp()  # (L, chunks, batch, channels, state)

    # 2. the true state at each chunk's start, carried across chunks
    carried = x.new_zeros(state.shape[1:])
    starts = []
    for chunk_decay, chunk_state in zip(decay_since_start[-1].unbind(0), state.unbind(0)):
        starts.append(carried)
        carried = torch.addcmul(chunk_state, chunk_decay, carried)
    starts = torch.stack(starts)  # (chunks, batch, channels, state)

    # 3. each position reads its chunk-start state, decayed to it
    y = y + torch.einsum('lkbdn,kbdn->lkbd', decay_since_start * C, starts)
    return y.permute(2, 3, 1, 0).reshape(batch, channels, chunks * L)[..., :seq_len], carried


def segment_log_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """(..., L) per-step log-decays -> (..., L, L) with [l, s] = sum of log_decay[s+1 .. l] for l >= s
    and -inf above the diagonal. Summed per entry (a masked cumsum), not as a difference of two
    cumulative sums, so entries near the diagonal keep their precision."""
    L = log_decay.shape[-1]
    ones = torch.ones(L, L, dtype=torch.bool, device=log_decay.device)
    after_s = ones.tril(-1)  # [j, s]: step j lies after s
    per_step = log_decay[..., :, None].expand(*log_decay.shape, L).masked_fill(~after_s, 0.0)
    return per_step.cumsum(dim=-2).masked_fill(~ones.tril(), float('-inf'))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD without the D skip and the gate/norm.

    x: (batch, T, heads, head_dim); dt: (batch, T, heads), positive (after softplus and dt_limit);
    A: (heads,), <= 0; B, C: (batch, T, groups, state), heads a multiple of groups (head i reads
    group i // (heads / groups)). Returns y (batch, T, heads, head_dim) and the final state
    (batch, heads, head_dim, state), in the compute dtype.
    """
    with _autocast_off(x.device.type):
        return _ssd_scan(*_compute_dtype(x, dt, A, B, C), chunk_size)


def _ssd_scan(x, dt, A, B, C, chunk_size):
    batch, seq_len, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    per_group = heads // groups
    L = chunk_size
    chunks = -(-seq_len // L)
    pad = chunks * L - seq_len
    x, dt, B, C = (_pad_time(t, 1, pad) for t in (x, dt, B, C))
    x = x.view(batch, chunks, L, groups, per_group, head_dim)
    dt = dt.view(batch, chunks, L, groups, per_group)
    B = B.view(batch, chunks, L, groups, state_size)
    C = C.view(batch, chunks, L, groups, state_size)

    x_dt = x * dt[..., None]
    # (batch, chunks, groups, per_group, L): per-step log-decay and its running sum in the chunk
    log_decay = (dt * A.view(groups, per_group)).permute(0, 1, 3, 4, 2)
    cum = log_decay.cumsum(dim=-1)

    # 1. within each chunk: masked decay times C.B, applied to the inputs
    scores = torch.einsum('bklgn,bksgn->bkgls', C, B)
    weights = scores[:, :, :, None] * segment_log_decay(log_decay).exp()  # (b, k, g, r, L, L)
    y = torch.einsum('bkgrls,bksgrp->bklgrp', weights, x_dt)

    # 2. each chunk's own contribution to the state at its end
    to_end = (cum[..., -1:] - cum).exp()  # <= 1: cum is non-increasing
    chunk_states = torch.einsum('bksgn,bksgrp->bkgrpn', B, x_dt * to_end.permute(0, 1, 4, 2, 3)[..., None])

    # 3. the state at each chunk's start (and after the last): states summed with their decays
    chunk_log_decay = F.pad(cum[..., -1].permute(0, 2, 3, 1), (1, 0))  # (b, g, r, chunks + 1)
    carry = segment_log_decay(chunk_log_decay).exp()  # (b, g, r, chunks + 1, chunks + 1)
    chunk_states = F.pad(chunk_states, (0, 0, 0, 0, 0, 0, 0, 0, 1, 0))  # a zero state before chunk 0
    states = torch.einsum('bgrzc,bcgrpn->bzgrpn', carry, chunk_states)
    starts, final = states[:, :-1], states[:, -1]

    # 4. each position reads its chunk-start state, decayed to it
    y = y + torch.einsum('bklgn,bkgrpn->bklgrp', C, starts) * cum.exp().permute(0, 1, 4, 2, 3)[..., None]
    y = y.reshape(batch, chunks * L, heads, head_dim)[:, :seq_len]
    return y, final.reshape(batch, heads, head_dim, state_size)
