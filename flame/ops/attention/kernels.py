"""Triton kernels for causal attention with softmax, softpick or rectified-softmax rows.

Layout: q [N_tok, HQ, D], k/v [N_tok, HK, D] (tokens flattened over batch and documents),
statistics [HQ, N_tok] in float32 (head-major: the backward's key-block programs read a run of
consecutive queries of one head per tile). Logits are kept in base 2: ``s2 = (q . k) * scale * log2(e)``.

Per query row i and admissible key j (causal, same document):

* softmax:   w_ij = 2^(s2_ij - m_i) / l_i,  l_i = sum_j 2^(s2_ij - m_i)
* rectified: the same over keys with s_ij >= 0 only (rows without any give 0)
* softpick:  w_ij = relu(e^s_ij - 1) / (sum_j |e^s_ij - 1| + eps); with the running max
  m_i = max(0, max_j s2_ij) both sums are scaled by 2^-m_i, so every term lies in [-1, 1]:
  relu(2^(s2 - m) - 2^-m) / (sum |2^(s2 - m) - 2^-m| + eps 2^-m).

Forward stores ``lse2_i = m_i + log2(den_i)`` (base-2 log of the un-scaled denominator), so the
backward recomputes ``g_ij = 2^(s2_ij - lse2_i)`` = exp(s_ij) / den_i.

Backward (D_i = sum_d dO_id O_id, dp_ij = dO_i . v_j):

* softmax / rectified: ds_ij = w_ij (dp_ij - D_i)
* softpick:            ds_ij = g_ij ([s_ij > 0] dp_ij - sign(s_ij) D_i), with sign(0) taken as -1
  (the left derivative at the kink s_ij = 0)

D_i comes from ``bwd_delta_kernel`` (one fused pass over O and dO). The backward tiles take the
raw product q . k and fold the scale into one multiply-add with -lse2; sign tests use the raw
product (scale > 0, RAW_SIGN) and masked entries become -inf before the exp2.

Grids are (blocks of the longest document, heads, documents); programs past the end of their
document exit at once, and the most loaded blocks are launched first. Masked tiles (the
diagonal, and a partial last query tile in dK/dV) and unmasked tiles run in separate loops; the
inner tile must divide the outer one.
"""
from __future__ import annotations

import triton
import triton.language as tl

MODE_IDS = {"softmax": 0, "softpick": 1, "rectified": 2}


@triton.jit
def _doc_bounds(CU, pid_doc, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(CU + pid_doc).to(tl.int64)
        eos = tl.load(CU + pid_doc + 1).to(tl.int64)
        seqlen = (eos - bos).to(tl.int32)
    else:
        bos = pid_doc.to(tl.int64) * T
        seqlen = T
    return bos, seqlen


@triton.jit
def _load_kv(k_base, v_base, kn, offs_d, mask_d, seqlen, KV_STRIDE, D: tl.constexpr, BD: tl.constexpr,
             MASKED: tl.constexpr):
    """Key and value rows `kn`; bounds masks only where a tile can cross the document's end or
    the head dim is padded (unmasked loads keep fewer registers live)."""
    kv_off = kn[:, None] * KV_STRIDE + offs_d[None, :]
    if MASKED or D != BD:
        kv_mask = (kn[:, None] < seqlen) & mask_d[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
    return k, v


@triton.jit
def _fwd_tiles(
    acc, l, m, q, k_base, v_base, offs_m, lo, hi, seqlen, scale_log2,
    KV_STRIDE, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr, BN: tl.constexpr,
):
    """With RAW_SIGN (scale > 0) maxima and sign tests use the raw product q . k, and the scale
    joins the exp2's argument as one multiply-add per element (no scaled copy of the tile)."""
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start in range(lo, hi, BN):
        kn = start + offs_n
        k, v = _load_kv(k_base, v_base, kn, offs_d, mask_d, seqlen, KV_STRIDE, D, BD, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if not RAW_SIGN:
            s = s * scale_log2
        if MASKED:
            valid = (offs_m[:, None] >= kn[None, :]) & (kn[None, :] < seqlen)
        if MODE == 2:
            keep = s >= 0
            if MASKED:
                keep = keep & valid
            s = tl.where(keep, s, float("-inf"))
        elif MASKED:
            s = tl.where(valid, s, float("-inf"))
        if RAW_SIGN:
            m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
            x = s * scale_log2 - m_new[:, None]
        else:
            m_new = tl.maximum(m, tl.max(s, 1))
            x = s - m_new[:, None]
        if MODE == 1:
            # masked entries: exp2(-inf) = 0, so e = -2^-m there; the select zeroes them
            e = tl.exp2(x) - tl.exp2(-m_new)[:, None]
            if MASKED:
                e = tl.where(valid, e, 0.0)
            p = tl.maximum(e, 0.0)
            row = tl.sum(tl.abs(e), 1)
        else:
            p = tl.exp2(x)
            row = tl.sum(p, 1)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + row
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    return acc, l, m


@triton.jit
def _query_block(CU, T, IS_VARLEN: tl.constexpr):
    """(query block, head, document start, document length) of this program. Query blocks run in
    reverse launch order: the last ones see the most keys, so they start first."""
    blk = tl.num_programs(0) - 1 - tl.program_id(0)
    bos, seqlen = _doc_bounds(CU, tl.program_id(2), T, IS_VARLEN)
    return blk, tl.program_id(1), bos, seqlen


@triton.jit
def _query_rows(bos, blk, h, seqlen, HQ, HK, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    """Rows of query block `blk` of head `h` in a [T, HQ, D] tensor (offsets and masks) and the
    offset of its key/value head in [T, HK, D] (GQA)."""
    offs_m = blk * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask_m = offs_m < seqlen
    q_mask = mask_m[:, None] & (offs_d[None, :] < D)
    q_off = bos * (HQ * D) + h * D + offs_m[:, None] * (HQ * D) + offs_d[None, :]
    kv_base = bos * (HK * D) + (h // (HQ // HK)) * D
    return offs_m, mask_m, q_off, q_mask, kv_base


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, CU, scale_log2, eps, T, NTOK,
    HQ, HK, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    # float scalars may arrive as fp64 (inductor types Python floats so): the loops need fp32
    scale_log2 = tl.cast(scale_log2, tl.float32)
    eps = tl.cast(eps, tl.float32)
    blk, h, bos, seqlen = _query_block(CU, T, IS_VARLEN)
    if blk * BM >= seqlen:
        return
    offs_m, mask_m, q_off, q_mask, kv_base = _query_rows(bos, blk, h, seqlen, HQ, HK, D, BD, BM)
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    k_base = K + kv_base
    v_base = V + kv_base

    acc = tl.zeros([BM, BD], dtype=tl.float32)
    l = tl.zeros([BM], dtype=tl.float32)
    if MODE == 0:
        m = tl.full([BM], -1.0e30, dtype=tl.float32)
    else:
        m = tl.zeros([BM], dtype=tl.float32)
    diag = blk * BM
    acc, l, m = _fwd_tiles(acc, l, m, q, k_base, v_base, offs_m, 0, diag, seqlen, scale_log2,
                           HK * D, D, BD, MODE, False, PREC, RAW_SIGN, BN)
    hi = tl.minimum(diag + BM, seqlen)
    acc, l, m = _fwd_tiles(acc, l, m, q, k_base, v_base, offs_m, diag, hi, seqlen, scale_log2,
                           HK * D, D, BD, MODE, True, PREC, RAW_SIGN, BN)

    if MODE == 1:
        den = l + eps * tl.exp2(-m)
        o = acc / den[:, None]
        lse = m + tl.log2(den)
    else:
        pos = l > 0
        safe = tl.where(pos, l, 1.0)
        o = tl.where(pos[:, None], acc / safe[:, None], 0.0)
        lse = tl.where(pos, m + tl.log2(safe), 1.0e30)
    tl.store(O + q_off, o.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + h * NTOK + bos + offs_m, lse, mask=mask_m)


@triton.jit
def bwd_delta_kernel(O, DO, DELTA, N, NTOK, HQ, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """sum_d O[r, d] * DO[r, d] in float32 for the N = tokens * heads rows r of O and DO (token-major),
    stored head-major: DELTA[r % HQ, r // HQ] of a [HQ, NTOK] tensor."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_d = tl.arange(0, BD)
    mask_r = rows < N
    mask = mask_r[:, None] & (offs_d[None, :] < D)
    off = rows[:, None].to(tl.int64) * D + offs_d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + (rows % HQ) * NTOK + rows // HQ, tl.sum(o * do, 1), mask=mask_r)


@triton.jit
def _weights_and_grad(
    s, dp, lse, c, delta, scale_log2, valid,
    MODE: tl.constexpr, MASKED: tl.constexpr, NEED_W: tl.constexpr, RAW_SIGN: tl.constexpr,
):
    """Attention weights w and logit gradient ds (w.r.t. base-e logits) for a tile.

    ``s`` is the raw product q . k (not yet scaled); ``lse``, ``c`` (= 2^-lse, softpick only)
    and ``delta`` are per query, already broadcast along the query axis of the tile. With
    RAW_SIGN (scale > 0) the sign tests use ``s`` itself, so ``s * scale_log2 - lse`` stays a
    single fused multiply-add. Masked entries get ``-inf`` before the exp2: then g = 0 gives
    w = ds = 0 with no further select. Per element, softmax costs fma + exp2 + sub + mul;
    softpick adds a compare and a select (and sub + max when w is needed).
    """
    if RAW_SIGN:
        t = s
    else:
        t = s * scale_log2
    x = s * scale_log2 - lse
    if MODE == 2:
        keep = t >= 0
        if MASKED:
            keep = keep & valid
        x = tl.where(keep, x, float("-inf"))
    elif MASKED:
        x = tl.where(valid, x, float("-inf"))
    g = tl.exp2(x)
    if MODE == 1:
        # ds = g ([s > 0] dp - sign(s) D);  w = relu(g - 2^-lse) (> 0 exactly when s > 0). At s = 0
        # exactly, the kink of both relu(e^s - 1) and |e^s - 1|, ds takes the derivative from below
        # (g D): one select less per element than sign(0) = 0, and a subgradient all the same
        ds = g * tl.where(t > 0, dp - delta, delta)
        if NEED_W:
            w = tl.maximum(g - c, 0.0)
        else:
            w = g
    else:
        ds = g * (dp - delta)
        w = g
    return w, ds


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, lo, hi, seqlen, scale_log2,
    Q_STRIDE, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr, BM: tl.constexpr,
):
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start in range(lo, hi, BM):
        qm = start + tl.arange(0, BM)
        q_off = qm[:, None] * Q_STRIDE + offs_d[None, :]
        if MASKED or D != BD:
            mask_m = qm < seqlen
            q = tl.load(q_base + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            do = tl.load(do_base + q_off, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
            lse = tl.load(lse_base + qm, mask=mask_m, other=float("inf"))
            delta = tl.load(delta_base + qm, mask=mask_m, other=0.0)
        else:  # whole tiles inside the document: no bounds masks (fewer live registers)
            q = tl.load(q_base + q_off)
            do = tl.load(do_base + q_off)
            lse = tl.load(lse_base + qm)
            delta = tl.load(delta_base + qm)
        if MODE == 1:
            c = tl.exp2(-lse)
        else:
            c = lse
        sT = tl.dot(k, tl.trans(q), input_precision=PREC)       # [BN, BM], raw logits
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        valid = qm[None, :] >= offs_n[:, None]
        wT, dsT = _weights_and_grad(sT, dpT, lse[None, :], c[None, :], delta[None, :], scale_log2, valid,
                                    MODE, MASKED, True, RAW_SIGN)
        dv += tl.dot(wT.to(do.dtype), do, input_precision=PREC)
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU, scale_log2, scale, T, NTOK,
    HQ, HK, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr,
):
    scale_log2 = tl.cast(scale_log2, tl.float32)  # fp32 whatever the caller's scalar type (see attn_fwd_kernel)
    scale = tl.cast(scale, tl.float32)
    # key blocks in launch order: the first ones see the most queries, so they start first
    blk = tl.program_id(0)
    hk = tl.program_id(1)
    bos, seqlen = _doc_bounds(CU, tl.program_id(2), T, IS_VARLEN)
    if blk * BN >= seqlen:
        return
    offs_n = blk * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kv_mask = (offs_n[:, None] < seqlen) & (offs_d[None, :] < D)
    kv_off = bos * (HK * D) + hk * D + offs_n[:, None] * (HK * D) + offs_d[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BN, BD], dtype=tl.float32)
    dv = tl.zeros([BN, BD], dtype=tl.float32)
    diag = blk * BN
    diag_hi = tl.minimum(diag + BN, seqlen)
    full_hi = diag_hi + (seqlen - diag_hi) // BM * BM  # end of the whole query tiles below the diagonal
    for g in range(HQ // HK):
        h = hk * (HQ // HK) + g
        q_base = Q + bos * (HQ * D) + h * D
        do_base = DO + bos * (HQ * D) + h * D
        lse_base = LSE + h * NTOK + bos
        delta_base = DELTA + h * NTOK + bos
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, diag, diag_hi,
                             seqlen, scale_log2, HQ * D, D, BD, MODE, True, PREC, RAW_SIGN, BM)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, diag_hi, full_hi,
                             seqlen, scale_log2, HQ * D, D, BD, MODE, False, PREC, RAW_SIGN, BM)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, full_hi, seqlen,
                             seqlen, scale_log2, HQ * D, D, BD, MODE, True, PREC, RAW_SIGN, BM)
    dk = dk * scale
    tl.store(DK + kv_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(
    dq, q, do, lse, c, delta, k_base, v_base, offs_m, lo, hi, seqlen, scale_log2,
    KV_STRIDE, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr, BN: tl.constexpr,
):
    offs_d = tl.arange(0, BD)
    mask_d = offs_d < D
    for start in range(lo, hi, BN):
        kn = start + tl.arange(0, BN)
        k, v = _load_kv(k_base, v_base, kn, offs_d, mask_d, seqlen, KV_STRIDE, D, BD, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)         # raw logits
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        valid = (offs_m[:, None] >= kn[None, :]) & (kn[None, :] < seqlen)
        w, ds = _weights_and_grad(s, dp, lse, c, delta, scale_log2, valid, MODE, MASKED, False, RAW_SIGN)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU, scale_log2, scale, T, NTOK,
    HQ, HK, D: tl.constexpr, BD: tl.constexpr,
    MODE: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, RAW_SIGN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    scale_log2 = tl.cast(scale_log2, tl.float32)  # fp32 whatever the caller's scalar type (see attn_fwd_kernel)
    scale = tl.cast(scale, tl.float32)
    blk, h, bos, seqlen = _query_block(CU, T, IS_VARLEN)
    if blk * BM >= seqlen:
        return
    offs_m, mask_m, q_off, q_mask, kv_base = _query_rows(bos, blk, h, seqlen, HQ, HK, D, BD, BM)
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0)
    lse = tl.load(LSE + h * NTOK + bos + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(DELTA + h * NTOK + bos + offs_m, mask=mask_m, other=0.0)
    # per-row constants, broadcast once outside the tile loops
    lse_b = lse[:, None]
    delta_b = delta[:, None]
    k_base = K + kv_base
    v_base = V + kv_base
    dq = tl.zeros([BM, BD], dtype=tl.float32)
    diag = blk * BM
    dq = _dq_tiles(dq, q, do, lse_b, lse_b, delta_b, k_base, v_base, offs_m, 0, diag, seqlen, scale_log2,
                   HK * D, D, BD, MODE, False, PREC, RAW_SIGN, BN)
    hi = tl.minimum(diag + BM, seqlen)
    dq = _dq_tiles(dq, q, do, lse_b, lse_b, delta_b, k_base, v_base, offs_m, diag, hi, seqlen, scale_log2,
                   HK * D, D, BD, MODE, True, PREC, RAW_SIGN, BN)
    dq = dq * scale
    tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=q_mask)
