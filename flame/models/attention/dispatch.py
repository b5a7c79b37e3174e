"""Layer-level dispatch: run one backend on [B, T, H, D] tensors, with the right fallback.

Paths (q: [B, Tq, HQ, D], k/v: [B, Tk, HK, D]):
* weights requested, impl 'naive', or a non-softmax backend off-GPU / in decode / with padding
  or a sliding window -> ``naive_attention`` (pure torch, returns the weights)
* softpick / rectified on CUDA -> flame's Triton kernels
* softmax, decode / padding / window -> SDPA with an explicit boolean mask
* softmax dense -> SDPA (causal), FLA parallel_attn, flame Triton or FlexAttention per impl
* softmax with cu_seqlens -> GPU: torch varlen_attn (flash attention; bf16/fp16, head dim <= 256),
  else FlexAttention with a document mask (always for impl 'flex', or with ``FLAME_VARLEN_SOFTMAX=flex``);
  CPU: SDPA with a dense block-diagonal causal mask (FlexAttention has no CPU backward)
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from flame.models.attention.registry import AttentionBackend
from flame.ops.attention import build_valid_mask, naive_attention, parallel_attention, triton_interpreting
from flame.utils.kernel_env import kernel_env


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda or triton_interpreting()


def reads_max_seqlen(backend: AttentionBackend, x: torch.Tensor, head_dim: int) -> bool:
    """Whether `attention` with ``cu_seqlens`` uses ``max_seqlen`` in a layer of head dim `head_dim`
    whose input activations are `x` (the caller then computes it once per forward: a host sync);
    FlexAttention and the CPU paths do not."""
    if backend.impl == "naive" or not _on_gpu(x):
        return False
    if backend.rows != "softmax" or backend.impl == "triton":
        return True
    return backend.impl not in ("fla", "flex") and x.is_cuda and _softmax_varlen_attn(_compute_dtype(x), head_dim)


def uses_flex_varlen(backend: AttentionBackend, x: torch.Tensor, window_size: int | None, head_dim: int) -> bool:
    """Whether `attention` with ``cu_seqlens`` in such a layer runs FlexAttention with a document
    mask (the caller may then build the mask once per forward with `varlen_block_mask`)."""
    if backend.rows != "softmax" or backend.impl in ("naive", "fla", "triton") or window_size is not None:
        return False
    return x.is_cuda and (backend.impl == "flex" or not _softmax_varlen_attn(_compute_dtype(x), head_dim))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the projections of activations `x`: autocast's where it is on, else x's own."""
    device = "cuda" if x.is_cuda else "cpu"
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


VARLEN_ATTN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_ATTN_MAX_HEAD_DIM = 256


def _softmax_varlen_attn(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether softmax attention with ``cu_seqlens`` on GPU runs torch's varlen_attn: its flash kernel
    takes half precision and head dims up to 256; other inputs take FlexAttention."""
    return (kernel_env("FLAME_VARLEN_SOFTMAX") == "varlen" and _varlen_attn() is not None
            and dtype in VARLEN_ATTN_DTYPES and head_dim <= VARLEN_ATTN_MAX_HEAD_DIM)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: AttentionBackend,
    *,
    scale: float | None = None,
    eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window_size: int | None = None,
    need_weights: bool = False,
    block_mask=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention output [B, Tq, HQ, D] and (for the naive path only) the weights.
    ``block_mask``: the FlexAttention mask of ``cu_seqlens`` when the caller built it (`varlen_block_mask`)."""
    B, tq, hq, d = q.shape
    tk = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    decode = tq != tk
    if cu_seqlens is not None and decode:
        raise ValueError("cu_seqlens cannot be combined with cached keys")
    padded = key_padding_mask is not None and not bool(key_padding_mask[:, -tk:].all())
    if not padded:
        key_padding_mask = None
    irregular = decode or padded or window_size is not None
    if need_weights or backend.impl == "naive" or (backend.rows != "softmax" and (irregular or not _on_gpu(q))):
        return naive_attention(
            q, k, v, backend.rows, scale=scale, eps=eps, cu_seqlens=cu_seqlens,
            key_padding_mask=key_padding_mask, window_size=window_size, return_weights=need_weights,
        )
    if backend.rows != "softmax":
        return parallel_attention(q, k, v, backend.rows, scale=scale, eps=eps, cu_seqlens=cu_seqlens,
                                  max_seqlen=max_seqlen), None
    if irregular:
        return _sdpa_masked(q, k, v, scale, cu_seqlens, key_padding_mask, window_size), None
    if backend.impl == "fla" and q.is_cuda:
        return _fla_parallel(q, k, v, scale, cu_seqlens), None
    if backend.impl == "triton" and _on_gpu(q):
        return parallel_attention(q, k, v, "softmax", scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen), None
    if cu_seqlens is None and backend.impl != "flex":
        return _sdpa_causal(q, k, v, scale), None
    if q.is_cuda:
        if cu_seqlens is None:
            return _flex(q, k, v, scale, None), None
        if backend.impl != "flex" and _softmax_varlen_attn(q.dtype, d):
            return _torch_varlen(q, k, v, scale, cu_seqlens, max_seqlen), None
        return _flex(q, k, v, scale, cu_seqlens, block_mask=block_mask), None
    if cu_seqlens is None:
        return _sdpa_causal(q, k, v, scale), None
    return _sdpa_masked(q, k, v, scale, cu_seqlens, None, None), None


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _sdpa_causal(q, k, v, scale):
    o = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), is_causal=True, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


def _sdpa_masked(q, k, v, scale, cu_seqlens, key_padding_mask, window_size):
    B, tq, hq, d = q.shape
    tk = k.shape[1]
    if cu_seqlens is not None and B > 1:
        o = _sdpa_masked(q.reshape(1, B * tq, hq, d), k.reshape(1, B * tk, *k.shape[2:]),
                         v.reshape(1, B * tk, *v.shape[2:]), scale, cu_seqlens, None, window_size)
        return o.reshape(B, tq, hq, -1)
    valid = build_valid_mask(tq, tk, device=q.device, cu_seqlens=cu_seqlens,
                             key_padding_mask=key_padding_mask, window_size=window_size)
    # rows without any admissible key (padding queries) attend to themselves instead of NaN
    diag = torch.arange(tk, device=q.device)[None, :] == (torch.arange(tq, device=q.device)[:, None] + tk - tq)
    valid = valid | (~valid.any(-1, keepdim=True) & diag)
    o = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=valid, scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


def _fla_parallel(q, k, v, scale, cu_seqlens):
    from fla.ops.attn import parallel_attn

    B, T = q.shape[:2]
    if cu_seqlens is not None and B > 1:
        q, k, v = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v))
    o = parallel_attn(q, k, v, scale=scale, cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return o.reshape(B, T, *o.shape[2:])


def _resolve_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# resolved at import, not on first use: a global set during a compiled block's first trace is a
# guard that fails on the next call (one recompilation of every compiled block)
_VARLEN_ATTN = _resolve_varlen_attn()


def _varlen_attn():
    return _VARLEN_ATTN


def _torch_varlen(q, k, v, scale, cu_seqlens, max_seqlen):
    fn = _varlen_attn()
    B, T, hq, d = q.shape
    hk = k.shape[2]
    params = inspect.signature(fn).parameters
    q2, k2, v2 = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v))
    kw = {"scale": scale} if "scale" in params else {}
    if hq != hk:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k2 = k2.repeat_interleave(hq // hk, dim=1)
            v2 = v2.repeat_interleave(hq // hk, dim=1)
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    cu = cu_seqlens.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    o = fn(q2, k2, v2, cu, cu, max_seqlen, max_seqlen, **kw)
    return o.reshape(B, T, hq, -1)


_FLEX = None
_MASK_CACHE: list = []   # [((cu_seqlens tensor (kept alive), its _version, length, left), BlockMask)]
_MASK_CACHE_SIZE = 4     # hybrids alternate windowed and full layers: keep a few masks per step


def flex_mask_mod(L: int, cu_seqlens: torch.Tensor | None, left: int | None, device):
    """FlexAttention mask_mod: causal, within a document (``cu_seqlens``), and at most ``left``
    keys back (flash-attn's ``window_size=(left, 0)``) when ``left`` is given."""
    doc = None
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.to(device), torch.arange(L, device=device), right=True)

    def mask_mod(b, h, qi, kj):
        ok = qi >= kj
        if doc is not None:
            ok = ok & (doc[qi] == doc[kj])
        if left is not None:
            ok = ok & (qi - kj <= left)
        return ok

    return mask_mod


# Run eagerly also when called from a compiled block: the cache lookup compares tensor identities
# and versions, which dynamo would turn into graph breaks and guards that fail at every new batch.
@torch.compiler.disable
def _block_mask(L, cu_seqlens, left, device):
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        # made here, eagerly, before any compiled block reads it: a compiled block that saw it
        # unset would be compiled again at its next call
        _FLEX = torch.compile(flex_attention, dynamic=False)

    key = (cu_seqlens, getattr(cu_seqlens, "_version", 0), L, left)
    for k, bm in _MASK_CACHE:
        if k[0] is key[0] and k[1:] == key[1:]:
            return bm
    if cu_seqlens is not None and left is None:
        bm = document_block_mask(L, cu_seqlens, device)
    else:
        bm = create_block_mask(flex_mask_mod(L, cu_seqlens, left, device), None, None, L, L, device=device)
    _MASK_CACHE.insert(0, (key, bm))
    del _MASK_CACHE[_MASK_CACHE_SIZE:]
    return bm


FLEX_BLOCK = 128  # FlexAttention's default block size (rows and columns of one mask block)


def _first_true_first(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a [rows, cols] bool map: (number of True, column indices with the True ones first,
    in ascending order), the layout of BlockMask's ``kv_num_blocks``/``kv_indices``."""
    order = torch.sort(flags.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return flags.sum(-1).to(torch.int32), order.to(torch.int32)


def document_block_mask(L: int, cu_seqlens: torch.Tensor, device):
    """The causal document mask of ``cu_seqlens`` as a FlexAttention BlockMask, built from the
    documents' block boundaries: O((L/128)^2) work, where `create_block_mask` evaluates the mask
    at all L^2 positions (gigabytes and milliseconds a step at L = 64K)."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-L // FLEX_BLOCK)
    pos = torch.arange(L, device=device)
    doc = torch.searchsorted(cu_seqlens.to(device), pos, right=True)
    starts = torch.arange(nb, device=device) * FLEX_BLOCK
    ends = (starts + FLEX_BLOCK).clamp(max=L) - 1
    first, last = doc[starts], doc[ends]            # documents of each block's first and last token
    qi = torch.arange(nb, device=device)[:, None]   # query block (rows) x key block (columns)
    kj = torch.arange(nb, device=device)[None, :]
    # documents are contiguous and in order: key block j <= query block i shares one iff j's last
    # document reaches i's first
    any_pair = (kj <= qi) & (last[None, :] >= first[:, None])
    one_doc = first == last
    whole = (ends - starts + 1) == FLEX_BLOCK
    # every pair allowed: strictly below the diagonal, both blocks whole and inside the same document
    full = (kj < qi) & (one_doc & whole)[:, None] & (one_doc & whole)[None, :] & (first[:, None] == first[None, :])
    partial = any_pair & ~full
    num, idx = _first_true_first(partial)
    fnum, fidx = _first_true_first(full)
    return BlockMask.from_kv_blocks(num[None, None], idx[None, None], fnum[None, None], fidx[None, None],
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=flex_mask_mod(L, cu_seqlens, None, device),
                                    seq_lengths=(L, L))


def varlen_block_mask(total_tokens: int, cu_seqlens: torch.Tensor, device):
    """The causal document mask of ``cu_seqlens`` for FlexAttention. Models build it once per forward
    outside their (compiled) blocks and pass it down: every block then gets the same mask as a plain
    input, without tracing the mask construction."""
    return _block_mask(total_tokens, cu_seqlens, None, device)


def _flex(q, k, v, scale, cu_seqlens, left: int | None = None, block_mask=None):
    """Causal FlexAttention on [B, T, H, D]; documents by ``cu_seqlens`` (over the flattened B*T
    tokens), optional sliding window of ``left`` keys back; ``block_mask`` when built by the caller
    (with `varlen_block_mask`, which also makes the compiled FlexAttention this calls)."""
    B, T, hq = q.shape[:3]
    if cu_seqlens is not None and B > 1:
        q, k, v = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v))
    if block_mask is None:
        block_mask = _block_mask(q.shape[1], cu_seqlens, left, q.device)
    o = _FLEX(_heads_first(q), _heads_first(k), _heads_first(v), block_mask=block_mask, scale=scale,
              enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2).reshape(B, T, hq, -1)
