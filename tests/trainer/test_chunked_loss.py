"""training.loss_chunk_tokens: output projection + cross-entropy in token chunks.

The op against float64 autograd on fresh random inputs; the head swap on a real HF model; the
trainer with and without chunking (one process, FSDP2 on two gloo ranks, the offload engine, varlen)."""

import os
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flame.components import chunked_loss
from flame.components.chunked_loss import (chunked_head_loss, choose_loss_chunk_tokens, install_chunked_head,
                                           linear_cross_entropy_sum, take_chunked_loss)
from flame.errors import ConfigError
from tests.trainer.helpers import ROOT, TINY_LLAMA, losses, run_job, tiny_job, train_in_process
from tests.trainer.test_training import _flame

SEED = int.from_bytes(os.urandom(3), "little")


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_autograd(chunk, with_bias):
    g = torch.Generator().manual_seed(SEED + chunk)
    n, d, v = 93, 24, 211
    h = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.2] = -100
    ins = [t for t in (h, w, b) if t is not None]
    scale = torch.rand((), generator=g, dtype=torch.float64) + 0.5  # the incoming grad rescales
    ref = F.cross_entropy(F.linear(h, w, b), y, ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(ref * scale, ins)
    got = linear_cross_entropy_sum(h, w, b, y, chunk)
    grads = torch.autograd.grad(got * scale, ins)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12), SEED
    for a, r in zip(grads, want):
        assert torch.allclose(a, r, rtol=1e-10, atol=1e-12), (SEED, (a - r).abs().max())


@pytest.mark.parametrize("chunk", [5, 64])
def test_bf16_weight_grad_in_row_blocks_matches_float64(chunk):
    """bf16 inputs take the row-blocked weight-gradient path (float32 accumulator): against float64
    autograd on the same bf16-rounded values, within bf16 rounding of the chunk's softmax grads."""
    g = torch.Generator().manual_seed(SEED + 11 * chunk)
    n, d, v = 93, 24, 211  # chunk 5 -> row blocks of 43 of the 211 vocabulary rows
    h = torch.randn(n, d, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(torch.bfloat16).requires_grad_()
    b = torch.randn(v, generator=g).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    got = torch.autograd.grad(linear_cross_entropy_sum(h, w, b, y, chunk), (h, w, b))
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    want = torch.autograd.grad(F.cross_entropy(F.linear(h64, w64, b64), y, reduction="sum"), (h64, w64, b64))
    for a, r in zip(got, want):
        assert a.dtype == torch.bfloat16
        err = (a.double() - r).abs().max() / r.abs().max()
        assert err < 2e-2, (SEED, chunk, err)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create while the mode is on, each counted until the last
    tensor object viewing it is gone."""

    def __init__(self):
        super().__init__()
        self.refs, self.size, self.now, self.peak = {}, {}, 0, 0

    def _drop(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            self.now -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self.size:
                    self.size[key], self.refs[key] = t.untyped_storage().nbytes(), 0
                    self.now += self.size[key]
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


def test_bf16_forward_peak_is_what_the_planner_counts():
    """Inside the forward, bf16 logits: the float32 weight-grad accumulator, the hidden-state grad
    and per chunk one float32 [chunk, vocab] tensor beside the bf16 logits (the offload planner's
    `loss_chunk_transient_bytes`). log_softmax(bf16, dtype=float32) held a converted copy and its
    output at once: 16 MiB more here."""
    n, d, v, c = 2048, 64, 8192, 512
    g = torch.Generator().manual_seed(SEED)
    h = torch.randn(n, d, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g) * d**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)
    with _LiveBytes() as live:
        chunked_loss.linear_cross_entropy_sum(h, w, None, y, c)
    planned = v * d * 4 + max(c * v * (4 + 2), v * d * 2)
    assert live.peak <= planned + n * d * 2 + 2**20, (live.peak / 2**20, planned / 2**20)


def test_only_requested_grads_and_all_ignored():
    g = torch.Generator().manual_seed(SEED)
    h = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, generator=g, dtype=torch.float64)  # frozen head
    y = torch.full((10,), -100)
    loss = linear_cross_entropy_sum(h, w, None, y, 4)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0
    y[3] = 5
    h.grad = None
    linear_cross_entropy_sum(h, w, None, y, 4).backward()
    ref = torch.autograd.grad(F.cross_entropy(F.linear(h, w), y, ignore_index=-100, reduction="sum"), h)[0]
    assert torch.allclose(h.grad, ref)


def _tiny_hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(TINY_LLAMA)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(cfg).double()


def test_head_swap_on_a_real_model_gives_the_plain_loss_and_grads():
    model = _tiny_hf_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 19))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    plain = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten(), reduction="sum")
    want = torch.autograd.grad(plain, list(model.parameters()))
    head = install_chunked_head(model, 5)
    with chunked_head_loss(head, labels):
        out = model(ids).logits
    loss = take_chunked_loss(head, out)
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert loss.item() == pytest.approx(plain.item(), rel=1e-12)
    for a, r in zip(got, want):
        assert torch.allclose(a, r, rtol=1e-9, atol=1e-12)
    # outside the context the head is an ordinary Linear again (generation, validation)
    assert model(ids).logits.shape == (2, 19, model.config.vocab_size)


def test_model_that_changes_the_head_output_is_refused():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 9, bias=False)

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, x):
            return self.lm_head(x) * 0.5  # logit scaling after the head

    m = Scaled()
    head = install_chunked_head(m, 2)
    with chunked_head_loss(head, torch.zeros(3, dtype=torch.long)):
        out = m(torch.randn(3, 4))
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        take_chunked_loss(head, out)
    with pytest.raises(ConfigError, match="not a plain nn.Linear"):
        install_chunked_head(nn.Sequential(), 2)


COMMON = ["--training.steps", "4", "--checkpoint.no-enable-checkpoint", "--checkpoint.no-enable",
          "--optimizer.implementation", "for-loop", "--optimizer.eps", "1e-8"]


@pytest.mark.parametrize("nproc, extra", [
    (1, []),
    (2, []),  # FSDP2: the head's weight is unsharded inside its own forward, where the loss is made
    (1, ["--training.varlen", "--training.context_len", "32"]),
])
def test_trainer_losses_match_unchunked(tmp_path, nproc, extra):
    a, b = str(tmp_path / "plain"), str(tmp_path / "chunked")
    run_job(nproc, a, *COMMON, *extra)
    run_job(nproc, b, *COMMON, *extra, "--training.loss_chunk_tokens", "48")
    la, lb = losses(a), losses(b)
    assert len(la) == 4 and lb == pytest.approx(la, rel=1e-5, abs=1e-5), (la, lb)


def test_offloaded_trainer_with_chunked_loss_matches_plain(tmp_path):
    # the reference is offloaded too: its weights are initialized in host memory like the chunked
    # run's (a plain run on a GPU draws them from the CUDA generator instead)
    profile = os.path.join(ROOT, "flame/offload/profiles/h100_80gb_measured.json")
    offload = ["--offload.enable", "on", "--offload.profile", profile, "--offload.overrides", "weights[*]=host",
               "--offload.compute_dtype", "float32"]
    a, b = str(tmp_path / "plain"), str(tmp_path / "chunked")
    run_job(1, a, *COMMON, "--training.loss_chunk_tokens", "0", *offload)
    run_job(1, b, *COMMON, "--training.loss_chunk_tokens", "100", *offload)
    la, lb = losses(a), losses(b)
    assert len(la) == 4 and lb == pytest.approx(la, rel=1e-4, abs=1e-4), (la, lb)


@pytest.mark.parametrize("extra, fragment", [
    (["--training.loss_chunk_tokens", "-2"], "training.loss_chunk_tokens -2"),
    (["--training.loss_chunk_tokens", "64", "--parallelism.tensor_parallel_degree", "2"], "tensor parallel degree 2"),
])
def test_bad_chunk_settings_are_one_line_errors(tmp_path, extra, fragment):
    proc = _flame(*tiny_job(str(tmp_path / "run"), "--training.steps", "2"), *extra)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("flame: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_matches_plain_and_uses_less_memory():
    """bf16 on the GPU, 8192 tokens x 128256 vocab, some ignored: loss and grads within bf16 tolerance
    of the plain float32 cross-entropy, and a lower peak (the plain loss holds 4.2 GB of float32
    logits). The weight gradient takes the CUDA path (one mixed-dtype GEMM per chunk)."""
    g = torch.Generator(device="cuda").manual_seed(SEED)
    n, d, v = 8192, 1024, 128256
    h0 = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.05] = -100  # ignored tokens

    def run(fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(h, w)
        loss.backward()
        torch.cuda.synchronize()
        return loss.float(), h.grad.float(), w.grad.float(), torch.cuda.max_memory_allocated() - base

    plain = run(lambda h, w: F.cross_entropy(F.linear(h, w).float(), y, reduction="sum"))
    chunked = run(lambda h, w: linear_cross_entropy_sum(h, w, None, y, 1024))
    assert chunked[0].item() == pytest.approx(plain[0].item(), rel=1e-3)
    for a, b in zip(chunked[1:3], plain[1:3]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert chunked[3] < 0.5 * plain[3], (chunked[3], plain[3])


class _Model(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def get_output_embeddings(self):
        return self.head


def test_auto_loss_choice():
    """training.loss_chunk_tokens -1: chunked above 1 GiB of float32 logits per micro-batch, with the
    chunk from the vocabulary; plain at or below it, for other heads and under tensor parallelism."""
    def head(v):
        return nn.Linear(1024, v, bias=False, device="meta")

    chunk, why = choose_loss_chunk_tokens(_Model(head(32000)), 16 * 4096, False)  # the softpick paper's batch
    assert chunk == 4096 and "chunked head+loss, 4096-token chunks" in why and "7.8 GiB" in why, why
    assert choose_loss_chunk_tokens(_Model(head(128256)), 8192, False)[0] == 1024
    at = chunked_loss.AUTO_CHUNK_ABOVE_BYTES // (4 * 2048)  # tokens whose logits are exactly the threshold
    assert choose_loss_chunk_tokens(_Model(head(2048)), at, False)[0] == 0
    assert choose_loss_chunk_tokens(_Model(head(2048)), at + 1, False)[0] > 0
    # on an 80 GiB GPU the paper's 7.8 GiB of logits stay plain under the compiled loss (an eighth of
    # the device is allowed), and are chunked under the eager loss (which holds about three copies);
    # a 16 GiB budget chunks them
    assert choose_loss_chunk_tokens(_Model(head(32000)), 16 * 4096, False, 80 * 2**30, compiled_loss=True)[0] == 0
    chunk, why = choose_loss_chunk_tokens(_Model(head(32000)), 16 * 4096, False, 80 * 2**30)
    assert chunk == 4096 and "x3 uncompiled" in why, why
    assert choose_loss_chunk_tokens(_Model(head(32000)), 4 * 4096, False, 80 * 2**30)[0] == 0
    assert choose_loss_chunk_tokens(_Model(head(32000)), 16 * 4096, False, 16 * 2**30)[0] == 4096
    assert choose_loss_chunk_tokens(_Model(head(2048)), at + 1, False, 2**30)[0] > 0  # never above 1 GiB
    chunk, why = choose_loss_chunk_tokens(_Model(head(32000)), 16 * 4096, True)
    assert chunk == 0 and "tensor parallelism" in why
    chunk, why = choose_loss_chunk_tokens(_Model(nn.Sequential(head(32000))), 16 * 4096, False)
    assert chunk == 0 and "Sequential" in why


def test_trainer_auto_chunked_matches_plain(tmp_path, monkeypatch):
    """Auto mode with the threshold below this micro-batch's logits takes the chunked loss (chunks of
    128 tokens of the 256): the plain loss's losses, and its gradients at every step."""
    vocab = 8192  # the tiny transformer's
    args = ["--training.steps", "3", *COMMON[2:]]
    config = os.path.join(ROOT, "configs/debug/transformer_tiny.json")

    def run(name, *extra):
        grads = []

        def record(trainer):
            step = trainer.clip_and_step

            def recorded():
                grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
                return step()

            trainer.clip_and_step = recorded

        trainer = train_in_process(tiny_job(str(tmp_path / name), *args, *extra, config=config), record)
        return trainer, losses(str(tmp_path / name)), grads

    plain, la, ga = run("plain", "--training.loss_chunk_tokens", "0")
    assert plain.chunked_head is None
    monkeypatch.setattr(chunked_loss, "AUTO_CHUNK_ABOVE_BYTES", 4 * 64 * vocab * 4 - 1)
    monkeypatch.setattr(chunked_loss, "AUTO_CHUNK_BYTES", 128 * vocab * 4)
    monkeypatch.setattr(chunked_loss, "AUTO_CHUNK_MEMORY_SHARE", 0)  # on a GPU: the threshold alone, not a share of it
    auto, lb, gb = run("auto")
    assert auto.chunked_head is not None and auto.chunked_head._flame_chunk_tokens == 128
    assert len(la) == 3 and lb == pytest.approx(la, rel=1e-5, abs=1e-5), (la, lb)
    for a, b in zip(ga, gb):
        for name, want in a.items():
            err = ((b[name] - want).norm() / want.norm()).item()  # float32 sums in another order
            assert err < 1e-4, (name, err)
