"""``--optimizer.name Muon``: Muon's update against a float64 reference of its formula and against
torch.optim.Muon; a sharded model (FSDP2 / TP on 2 gloo ranks) updates as one device does; a run
split at step 2 and resumed gives the uninterrupted run's losses; offload is refused in one line."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.trainer.helpers import ROOT, TINY_LLAMA, losses, tiny_job, torchrun, train_in_process

torch_muon = pytest.importorskip("torch.optim._muon")

NS = (3.4445, -4.7750, 2.0315)  # the quintic Newton-Schulz coefficients of the Muon write-up


def ns_float64(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, from X = M / ||M||_F (transposed when tall)."""
    a, b, c = NS
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _torch_ns(m: torch.Tensor) -> torch.Tensor:
    return torch_muon._zeropower_via_newtonschulz(m, NS, 5, 1e-7).double()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.up = nn.Linear(8, 24)  # weight 24 x 8 (tall), bias 1-D
        self.down = nn.Linear(24, 8, bias=False)  # 8 x 24 (wide)


def _config(**kw):
    base = dict(name="Muon", lr=0.01, muon_lr=0.02, muon_momentum=0.9, muon_adjust_lr="match_rms_adamw",
                beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, no_weight_decay=["bias", "norm", "embed"],
                implementation="for-loop")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_update_is_the_formula_and_torch_muon(adjust):
    from flame.components.optimizer import build_optimizers

    torch.manual_seed(0)
    model = Tiny()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizers([model], _config(muon_adjust_lr=adjust), torch.device("cpu"))
    twin = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    torch_opt = torch.optim.Muon([twin["up.weight"], twin["down.weight"]], lr=0.02, weight_decay=0.1, momentum=0.9,
                                 adjust_lr_fn=adjust)
    grads = [{n: torch.randn(p.shape) for n, p in model.named_parameters()} for _ in range(2)]
    for g in grads:
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
            twin[n].grad = g[n].clone()
        opt.step()
        torch_opt.step()

    params = dict(model.named_parameters())
    for n in ("up.weight", "down.weight"):
        # torch.optim.Muon on the same matrix: the very same numbers
        assert torch.equal(params[n], twin[n]), n
        # float64 reference: momentum B = mu B + (1 - mu) G, Nesterov U = (1 - mu) G + mu B,
        # W <- W (1 - lr wd) - lr_adj NS(U), two steps
        a, b = start[n].shape
        scale = 0.2 * math.sqrt(max(a, b)) if adjust == "match_rms_adamw" else math.sqrt(max(1, a / b))
        for ns, tol in ((ns_float64, 3e-2), (_torch_ns, 2e-5)):
            w, buf = start[n].double(), torch.zeros(a, b, dtype=torch.float64)
            for g in grads:
                buf = 0.9 * buf + 0.1 * g[n].double()
                w = w * (1 - 0.02 * 0.1) - 0.02 * scale * ns(0.1 * g[n].double() + 0.9 * buf)
            moved, ref = params[n].double() - start[n].double(), w - start[n].double()
            # Newton-Schulz runs in bfloat16 (as in torch): the float64 iteration agrees to that
            # precision (1.4e-2 measured); with torch's iteration in the float64 composition, to the
            # float32 rounding of the weights (2.3e-6 measured)
            err = ((moved - ref).norm() / ref.norm()).item()
            assert err < tol, (n, ns.__name__, err)
    # embeddings and biases: AdamW (its own lr), untouched by Muon
    adamw = torch.optim.AdamW([twin["embed.weight"], twin["up.bias"]], lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.0, foreach=False)
    for n in ("embed.weight", "up.bias"):
        twin[n].data.copy_(start[n])
    for g in grads:
        for n in ("embed.weight", "up.bias"):
            twin[n].grad = g[n].clone()
        adamw.step()
    for n in ("embed.weight", "up.bias"):
        assert torch.equal(params[n], twin[n]), n


@pytest.mark.parametrize("shape", [(24, 8), (8, 24), (16, 16), (40, 96)])
def test_batched_newton_schulz_is_torch_per_matrix(shape):
    from flame.components.muon import newton_schulz_batched

    torch.manual_seed(0)
    # scales far apart: each matrix must be normalized by its own norm, not the stack's
    stack = torch.stack([torch.randn(shape) * 10.0 ** k for k in (-3, 0, 3)])
    out = newton_schulz_batched(stack, NS, 5, 1e-7).double()
    for m, got in zip(stack, out):
        want = _torch_ns(m)
        # the same bfloat16 products in another order at most: one bfloat16 rounding (2^-8) apart
        assert ((got - want).norm() / want.norm()).item() <= 2 ** -8, shape
        # and the bfloat16 iteration's own distance from the float64 one (1.4e-2 measured above)
        ref = ns_float64(m)
        assert ((got - ref).norm() / ref.norm()).item() < 3e-2, shape


class Stack(nn.Module):
    """Hidden matrices of a few shared shapes (square, tall, wide), as a transformer's layers have."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.square = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))
        self.up = nn.ModuleList(nn.Linear(16, 40) for _ in range(2))  # 40 x 16 (tall) and a bias
        self.down = nn.ModuleList(nn.Linear(40, 16, bias=False) for _ in range(2))  # 16 x 40 (wide)


@pytest.mark.parametrize("batch_elements", [None, 700])  # 700: buckets cut into pieces of 1-2 matrices
def test_batched_step_is_torch_muon_per_matrix(batch_elements, monkeypatch):
    from flame.components import muon
    from flame.components.optimizer import build_optimizers

    if batch_elements:
        monkeypatch.setattr(muon, "BATCH_ELEMENTS", batch_elements)
    torch.manual_seed(0)
    model = Stack()
    opt = build_optimizers([model], _config(), torch.device("cpu"))
    hidden = [n for n, p in model.named_parameters() if id(p) in muon.hidden_matrices(model)]
    assert len(hidden) == 7
    twin = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    # torch.optim.Muon updates one matrix at a time (the per-matrix loop flame ran before)
    torch_opt = torch.optim.Muon([twin[n] for n in hidden], lr=0.02, weight_decay=0.1, momentum=0.9,
                                 adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for n, p in model.named_parameters():
            p.grad = torch.randn(p.shape)
            twin[n].grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    params, inner = dict(model.named_parameters()), opt.optimizers[0]
    for n in hidden:
        # the same products in the same order on CPU: the very same numbers
        assert torch.equal(params[n], twin[n]), n
        assert torch.equal(inner.state[params[n]]["momentum_buffer"], torch_opt.state[twin[n]]["momentum_buffer"]), n
    pieces = [len(b) for b in muon._buckets([params[n] for n in hidden])]
    assert pieces == ([3, 2, 2] if batch_elements is None else [2, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("mode", ["fsdp", pytest.param("tp", marks=pytest.mark.slow)])
def test_sharded_update_equals_one_device(mode):
    proc = torchrun(2, [os.path.join(ROOT, "tests/trainer/scripts/muon_parity.py"), mode, TINY_LLAMA], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("muon update equals one device") == 2


def test_resume_is_exact(tmp_path):
    common = ["--optimizer.name", "Muon", "--lr_scheduler.total_steps", "4", "--checkpoint.interval", "2"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train_in_process(tiny_job(full, "--training.steps", "4", *common))
    train_in_process(tiny_job(split, "--training.steps", "2", *common))
    train_in_process(tiny_job(split, "--training.steps", "4", *common))  # resumes from step-2
    assert losses(split) == losses(full) and len(losses(full)) == 4
    assert losses(full)[-1] < losses(full)[0]


def test_offload_is_refused_in_one_line():
    from flame.config.manager import FlameConfigManager
    from flame.errors import ConfigError

    with pytest.raises(ConfigError, match="optimizer.name Muon with offload.enable on: the offload engine"):
        FlameConfigManager().parse_args(["--optimizer.name", "Muon", "--offload.enable", "on"])


def test_the_calculator_refuses_muon_when_auto_offloads(capsys):
    """`python -m flame.offload.plan` plans what the trainer would run: where `offload.enable auto`
    chooses to offload, the trainer refuses Muon, so the calculator must not print a plan for it."""
    import os

    from flame.offload.calculator import BUNDLED_PROFILES, main
    from tests.trainer.helpers import ROOT

    args = ["--job.config_file", os.path.join(ROOT, "flame/models/fla.toml"),
            "--model.config", os.path.join(ROOT, "configs/llama_1B.json"), "--training.batch_size", "2",
            "--training.seq_len", "8192", "--offload.gpu_memory_gib", "12", "--offload.host_memory_gib", "64",
            "--offload.profile", BUNDLED_PROFILES[0]]
    assert main(args) == 0 and "weights streamed" in capsys.readouterr().out  # AdamW: this job offloads
    assert main(args + ["--optimizer.name", "Muon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("flame: error: optimizer.name Muon with offload.enable auto")
