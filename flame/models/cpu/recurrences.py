"""Pure-torch sequence mixers used by flame's CPU fallbacks for FLA.

All functions here work on head-major tensors ``[B, H, T, D]`` in float32 and know nothing about
FLA's calling conventions; ``flame.models.cpu.ops`` adapts FLA's signatures to them.

Two formulations are used:

* ``chunked_gated_linear_attention``: the chunkwise-parallel form of a linear recurrence with a
  diagonal (per key-dim and/or per value-dim) decay,
  ``S_t = diag(a_t) S_{t-1} diag(b_t) + k_t v_t^T``, ``o_t = S_t^T q_t``.
  Within a chunk of C tokens the outputs come from a masked C x C attention-like product whose decay
  factors ``exp(G_i - G_j)`` (j <= i) are never larger than 1, so no overflow can happen for long
  sequences; across chunks a Python loop carries the state (T / C iterations instead of T).
  It covers GLA, HGRN2, GSA (two passes), simple/scalar gating and plain linear attention.
* ``delta_rule_recurrence``: the token-by-token (gated) delta rule. Its chunked form needs a
  triangular solve per chunk (WY representation); the recurrence is simpler, obviously right and
  fast enough for the tiny models and short sequences that CPU runs use.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 16


def _pad_time(x: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    """Right-pad dim 2 (time) with zeros; zero keys/values/log-gates leave the state unchanged."""
    if x is None or pad == 0:
        return x
    return F.pad(x, (0, 0, 0, pad))


def chunked_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated linear attention in chunked form.

    Args:
        q, k: ``[B, H, T, K]``; v: ``[B, H, T, V]``.
        gk: log decay on the key dimension ``[B, H, T, K]`` (<= 0), or None for no decay.
        gv: log decay on the value dimension ``[B, H, T, V]`` (<= 0), or None.
        scale: multiplier of q.
        initial_state: ``[B, H, K, V]`` or None.

    Returns:
        o ``[B, H, T, V]`` (float32) and the final state ``[B, H, K, V]`` (float32).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    q, k, v, gk, gv = (_pad_time(x.float() if x is not None else None, pad) for x in (q, k, v, gk, gv))
    q = q * scale
    N = (T + pad) // C
    q, k = q.view(B, H, N, C, K), k.view(B, H, N, C, K)
    v = v.view(B, H, N, C, V)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    # Intra-chunk scores A[i, j] = sum_k q_ik k_jk exp(Gk_ik - Gk_jk) for j <= i.
    if gk is not None:
        bk = gk.view(B, H, N, C, K).cumsum(3)
        diff = bk.unsqueeze(4) - bk.unsqueeze(3)  # [B,H,N,C(i),C(j),K]
        # masking before exp keeps the (positive, possibly huge) j > i entries out of the graph
        decay = torch.exp(diff.masked_fill(~causal[:, :, None], float('-inf')))
        A = torch.einsum('bhnik,bhnjk,bhnijk->bhnij', q, k, decay)
    else:
        bk = None
        A = torch.einsum('bhnik,bhnjk->bhnij', q, k).masked_fill(~causal, 0.0)
    if gv is not None:
        bv = gv.view(B, H, N, C, V).cumsum(3)
        dv = torch.exp((bv.unsqueeze(4) - bv.unsqueeze(3)).masked_fill(~causal[:, :, None], float('-inf')))
        o_intra = torch.einsum('bhnij,bhnjv,bhnijv->bhniv', A, v, dv)
    else:
        bv = None
        o_intra = A @ v

    # Inter-chunk: carry the state across chunks.
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    outs = []
    for n in range(N):
        qn, kn, vn = q[:, :, n], k[:, :, n], v[:, :, n]
        if bk is not None:
            qn = qn * bk[:, :, n].exp()
            last_k = bk[:, :, n, -1:]  # [B,H,1,K]
            kn = kn * (last_k - bk[:, :, n]).exp()
        on = qn @ S
        if bv is not None:
            on = on * bv[:, :, n].exp()
            last_v = bv[:, :, n, -1:]
            vn = vn * (last_v - bv[:, :, n]).exp()
        outs.append(on)
        if bk is not None:
            S = S * last_k.transpose(-1, -2).exp()
        if bv is not None:
            S = S * last_v.exp()
        S = S + kn.transpose(-1, -2) @ vn
    o = torch.stack(outs, dim=2) + o_intra
    return o.reshape(B, H, N * C, V)[:, :, :T], S


class _MetaRecurrence(torch.autograd.Function):
    """Output [B, H, T, V] and final state [B, H, K, V] (float32), saving the inputs as FLA's chunk
    kernels do; meta tensors only."""

    @staticmethod
    def forward(ctx, q, k, v, beta, *gates):
        ctx.save_for_backward(q, k, v, beta, *gates)
        B, H, T, K = q.shape
        return q.new_empty(B, H, T, v.shape[-1], dtype=torch.float32), q.new_empty(B, H, K, v.shape[-1],
                                                                                   dtype=torch.float32)

    @staticmethod
    def backward(ctx, do, ds):
        return tuple(torch.empty_like(x) for x in ctx.saved_tensors)


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Gated) delta rule, token by token.

    ``S_t = decay_t * S_{t-1};  S_t += k_t (beta_t * (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)``.

    Args:
        q, k: ``[B, H, T, K]``; v: ``[B, H, T, V]``.
        beta: ``[B, H, T]`` (head-wise) or ``[B, H, T, V]`` (element-wise).
        g: scalar log decay ``[B, H, T]`` or None; gk: per-key log decay ``[B, H, T, K]`` or None.
        initial_state: ``[B, H, K, V]`` or None.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    if q.device.type == "meta":
        # the offload planner's shape-only measurement: a chunk kernel's outputs and saved inputs,
        # not a T-step loop of meta ops (minutes for a 340M model at 4K tokens)
        gates = [x for x in (g, gk) if x is not None]
        return _MetaRecurrence.apply(q, k, v, beta, *gates)
    q, k, v, beta = (x.float() for x in (q, k, v, beta))
    q = q * scale
    if beta.dim() == 3:
        beta = beta.unsqueeze(-1)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    decay = None
    if g is not None:
        decay = g.float().exp()[..., None, None]  # [B,H,T,1,1]
    if gk is not None:
        dk = gk.float().exp()[..., None]  # [B,H,T,K,1]
        decay = dk if decay is None else decay * dk
    outs = []
    for t in range(T):
        if decay is not None:
            S = S * decay[:, :, t]
        kt = k[:, :, t]
        pred = torch.einsum('bhk,bhkv->bhv', kt, S)
        u = beta[:, :, t] * (v[:, :, t] - pred)
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum('bhk,bhkv->bhv', q[:, :, t], S))
    return torch.stack(outs, dim=2), S
