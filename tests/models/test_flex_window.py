"""FlexAttention masks of the flash-attn stand-ins (sliding window, documents) vs explicit-mask SDPA.

The mask semantics are checked on CPU with eager FlexAttention (forward only: it has no CPU
backward); the GPU tests run the stand-ins themselves (compiled FlexAttention) forward and backward,
and a samba model (sliding-window attention layers) through a training step."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flame.models.attention.dispatch import document_block_mask, flex_mask_mod
from flame.models.cpu import modules as M

CASES = [(None, None), (None, [0, 13, 29, 40]), (5, None), (5, [0, 13, 29, 40]), (0, [0, 40])]


def _reference(q, k, v, left, cu):
    ws = (-1, 0) if left is None else (left, 0)
    if cu is None:
        return M._sdpa(q, k, v, True, ws)
    cu = torch.tensor(cu, device=q.device)
    outs = [M._sdpa(q[:, a:b], k[:, a:b], v[:, a:b], True, ws) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat(outs, 1)


@pytest.mark.parametrize("left,cu", CASES)
def test_flex_mask_matches_explicit_mask_cpu(left, cu):
    g = torch.Generator().manual_seed(hash((left, str(cu))) % 2**31)
    L, H, D = 40, 4, 8
    q = torch.randn(1, L, H, D, generator=g)
    k, v = (torch.randn(1, L, 2, D, generator=g) for _ in range(2))
    cut = None if cu is None else torch.tensor(cu)
    bm = create_block_mask(flex_mask_mod(L, cut, left, "cpu"), None, None, L, L, device="cpu")
    o = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(o.transpose(1, 2), _reference(q, k, v, left, cu), atol=1e-5, rtol=1e-5)


def _block_map(num, idx, n_kv):
    out = torch.zeros(num.shape[-1], n_kv, dtype=torch.bool)
    for i, count in enumerate(num[0, 0].tolist()):
        out[i, idx[0, 0, i, :count].long()] = True
    return out


@pytest.mark.parametrize("L", [300, 1537])
def test_document_block_mask_matches_create_block_mask(L):
    """The mask built from the documents' block boundaries has the blocks (partial and full) that
    create_block_mask finds by evaluating every position, and the same attention output."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    for trial in range(3):
        cuts = sorted(set(torch.randint(1, L, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist()))
        if trial == 0:
            cuts = [128, 256] if L > 256 else []  # documents on block boundaries: full blocks
        cu = torch.tensor([0, *cuts, L], dtype=torch.int32)
        got = document_block_mask(L, cu, "cpu")
        ref = create_block_mask(flex_mask_mod(L, cu, None, "cpu"), None, None, L, L, device="cpu")
        nb = -(-L // 128)
        for part, full in ((("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")),
                           (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices"))):
            maps = [[_block_map(getattr(bm, a), getattr(bm, b), nb) for a, b in (part, full)] for bm in (got, ref)]
            assert torch.equal(maps[0][0], maps[1][0]) and torch.equal(maps[0][1], maps[1][1]), (L, cuts, part)
        if L < 512:
            q, k, v = (torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
            o = flex_attention(q, k, v, block_mask=got)
            want = _reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, cu.tolist())
            torch.testing.assert_close(o.transpose(1, 2), want, atol=1e-10, rtol=1e-10)


def test_standin_rejects_non_causal_on_gpu_path():
    with pytest.raises(NotImplementedError, match="causal=False"):
        M._flex_left(False, (-1, -1))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("left,cu", CASES)
def test_standins_on_gpu_match_reference_fwd_bwd(left, cu):
    torch.manual_seed(7)
    L, H, D = 300, 4, 64
    q = torch.randn(1, L, H, D, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, L, 2, D, device="cuda", requires_grad=True) for _ in range(2))
    cu = None if cu is None else [c * L // 40 for c in cu]
    ws = (-1, 0) if left is None else (left * 7, 0)
    if cu is None:
        o = M.flash_attn_func_cpu(q, k, v, causal=True, window_size=ws)
    else:
        cut = torch.tensor(cu, device="cuda", dtype=torch.int32)
        o = M.flash_attn_varlen_func_cpu(q[0], k[0], v[0], cut, cut, causal=True, window_size=ws)[None]
    ref = _reference(q.double(), k.double(), v.double(), None if left is None else left * 7, cu)
    do = torch.randn_like(o)
    g = torch.autograd.grad(o, (q, k, v), do)
    gr = torch.autograd.grad(ref, (q, k, v), do.double())  # float64 math, float32 leaves
    torch.testing.assert_close(o.double(), ref, atol=2e-4, rtol=2e-4)
    for a, b in zip(g, gr):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-3, rtol=2e-3)


@gpu
def test_samba_trains_on_gpu_without_flash_attn():
    import fla.layers.attn as attn
    from transformers import AutoConfig, AutoModelForCausalLM

    from flame.models.cpu import prepare_model_build

    prepare_model_build("cuda")  # what the trainer does before it builds an FLA model
    assert attn.flash_attn_func is M.flash_attn_func_cpu  # flash-attn is absent on the test machines
    cfg = AutoConfig.from_pretrained("configs/debug/samba.json")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
