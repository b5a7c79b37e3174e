"""Calibration: compare measured step time and peak memory with the plan's prediction, refit.

The refit scales block compute time by measured/predicted (the part of the model least known
ahead: kernel efficiency at the real shapes, elementwise work); copies and the CPU optimizer use
measured rates already. If the step is off by more than 10%, the plan is solved again once with
the refit factor; the caller logs both and applies the new plan (next start, via a plan file, or
by rebuilding the engine).
"""

from __future__ import annotations

from dataclasses import asdict

from flame.offload.cost_model import Dtypes
from flame.offload.solver import Plan, solve

TOLERANCE = 0.10


def compare(plan: Plan, measured_step_s: float, measured_peak_bytes: int) -> dict:
    pr = plan.predicted
    return {
        "predicted_step_s": pr["step_s"], "measured_step_s": measured_step_s,
        "step_error": measured_step_s / pr["step_s"] - 1.0,
        "predicted_peak_gpu_bytes": pr["peak_gpu_bytes"], "measured_peak_gpu_bytes": measured_peak_bytes,
        "peak_error": measured_peak_bytes / pr["peak_gpu_bytes"] - 1.0,
    }


def refit(plan: Plan, costs, prof, measured_step_s: float, overrides=None) -> tuple[float, Plan | None]:
    """(fudge, new plan or None when within tolerance)."""
    pr = plan.predicted
    fudge = measured_step_s / pr["step_s"]
    if abs(fudge - 1.0) <= TOLERANCE:
        return fudge, None
    dt = Dtypes(**plan.dtypes)
    new = solve(costs, prof, dt, plan.gpu_budget_bytes, plan.host_budget_bytes, plan.micro_batch, plan.rounds,
                plan.cpu_threads, overrides=overrides, fudge=fudge)
    return fudge, new


__all__ = ["compare", "refit", "asdict"]


def _time(fn, iters: int = 3) -> float:
    """Seconds per call: CUDA events on a GPU (the profile's timer), a host clock otherwise."""
    import time

    import torch

    if torch.cuda.is_available():
        from flame.offload.profile import _time_cuda

        return _time_cuda(fn, iters)
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_block_fudge(config, costs, prof, micro_batch: int, seq_len: int, dtype, device: str = "cuda") -> dict:
    """Time one real block (fwd, fwd+bwd) on the GPU at the run's shapes and compare with the
    FLOP-based prediction; returns {"fudge": measured / predicted, ...} for `solve(fudge=...)`."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from flame.offload.cost_model import unit_times

    c1 = copy.deepcopy(config)
    c1.num_hidden_layers = 1
    c1.use_cache = False  # a KV cache would chain every timed call's graph to the previous one
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(c1, dtype=dtype)
    got = {}
    blk = m.model.layers[0]
    h = blk.register_forward_pre_hook(lambda mod, a, k: got.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        m(torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device), use_cache=False)
    h.remove()

    def prep(x):
        return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args = [prep(x) for x in got["a"]]
    kwargs = {k: prep(v) if k == "hidden_states" else v for k, v in got["k"].items() if k != "past_key_values"}

    def fwd():
        with torch.no_grad():
            blk(*args, **kwargs)

    def fwd_bwd():
        out = blk(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.backward(torch.ones_like(out))

    tf, tfb = _time(fwd), _time(fwd_bwd)
    pf, pb = unit_times(costs.layers[0], prof, micro_batch / costs.micro_batch)
    del m, blk, args, kwargs
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"fudge": tfb / (pf + pb), "measured_fwd_s": tf, "measured_fwd_bwd_s": tfb,
            "predicted_fwd_s": pf, "predicted_fwd_bwd_s": pf + pb}
