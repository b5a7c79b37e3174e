"""Calibration measurements: real blocks timed before the run, steps timed during it.

Before the run, `measure_block_fudges` times one real block at the run's shapes, at every
candidate micro-batch, and scales the cost model's compute times per candidate (build_plan); the
same pass times the outer (head, loss) as it runs and measures a recomputed block's backward
peak, which `planner.refit.use_block_calibration` puts into the costs.
During the run, `StepCalibrator` times a few steady steps once (steps 3-5 of the launch), logs
predicted vs measured step time and peak GPU memory, and, when the step is off by more than 10%,
refits and solves again, once (`planner.refit.refit`): first the CPU AdamW rate, from the seconds
the engine itself measured for it in the window (the profile's rate is a micro-benchmark), then
the compute scale with what is left of the error (the approximation: the copies use measured
rates, so the rest of the error is put on compute). A changed plan is written next to the
checkpoints (`offload_plan_calibrated.json`) and used from the next launch of the job on (a
resume), when it was made for the same dtypes, shapes, ranks and overrides and fits the budgets;
the running engine is not rebuilt mid-run (that would hold a second copy of the whole optimizer
state).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial

import torch
import torch.nn as nn

from flame.components.chunked_loss import chunked_head_loss, install_chunked_head, take_chunked_loss
from flame.models.blocks import find_block_list
from flame.offload.measure.timer import seconds_per_call
from flame.offload.planner.cost_model import unit_times
from flame.offload.planner.plan import Plan
from flame.offload.planner.refit import (CALIBRATED_PLAN, TOLERANCE, compare, cpu_adam_scale, refit, same_decisions,
                                        without_speculation)

logger = logging.getLogger(__name__)

GiB = 1024**3


class StepCalibrator:
    """Times steps 3..(2 + window) of this launch once (host-synchronized at the window's ends
    only), then compares, refits and writes a re-solved plan (see the module docstring). The
    trainer calls before_step/after_step around every step until after_step returns the report."""

    FIRST = 3  # the launch's first steps compile, pin memory and warm up

    def __init__(self, engine, plan: Plan, costs, prof, overrides, dump_folder: str, depths=(1, 2, 3),
                 window: int = 3, write: bool = True):
        self.engine, self.plan, self.costs, self.prof, self.depths = engine, plan, costs, prof, tuple(depths)
        self.overrides = list(overrides or [])
        self.path = os.path.join(dump_folder, CALIBRATED_PLAN)
        self.last = self.FIRST + window - 1
        self.write = write  # one writer (rank 0)
        self.n = 0
        self.t0 = 0.0

    def _sync(self) -> None:
        self.engine.synchronize()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def before_step(self) -> bool:
        """True when the timed window starts with this step."""
        self.n += 1
        if self.n == self.FIRST:
            self._sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            self.engine.reset_host_seconds()
            self.t0 = time.perf_counter()
        return self.n == self.FIRST

    def after_step(self, peak_bytes: int | None = None) -> dict | None:
        """The report once the window is over (then the caller drops the calibrator). `peak_bytes`:
        the window's GPU peak when something else resets the allocator's peak counter meanwhile
        (the trainer's metrics logger, at every log), else the allocator's own."""
        if self.n != self.last:
            return None
        self._sync()
        measured = (time.perf_counter() - self.t0) / (self.last - self.FIRST + 1)
        peak = peak_bytes
        if peak is None and torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated()
        rep = compare(self.plan, measured, peak)
        host = self.engine.reset_host_seconds()
        cpu_adam_s = host.get("cpu_adam", 0.0) / (self.last - self.FIRST + 1)
        cpu_scale = cpu_adam_scale(self.plan, self.costs, self.prof, cpu_adam_s)
        fudge, new = refit(self.plan, self.costs, self.prof, measured, self.overrides, self.depths, cpu_scale)
        rep["refit_compute_scale"] = fudge
        rep["measured_cpu_adam_s"] = cpu_adam_s
        # where the host time of a step went (the CPU worker's jobs, the training thread's waits)
        rep.update({f"host_{k}_s": v / (self.last - self.FIRST + 1) for k, v in sorted(host.items())})
        rep["refit_cpu_adam_scale"] = cpu_scale
        rep["replanned"] = new is not None and not same_decisions(new, self.plan)
        if self.plan.speculative_step:
            rep["predicted_step_without_speculation_s"] = without_speculation(self.plan, self.costs, self.prof)
        # without a GPU the plan's times are the profile's GPU's: the error says nothing of the planner
        peak_txt = f"{peak / GiB:.2f} GiB" if peak is not None else \
            "n/a (no GPU: this run is on the CPU, the prediction is for the profile's GPU)"
        reserved = self.plan.predicted.get("peak_gpu_reserved_bytes")
        logger.info("offload calibration (steps %d-%d of this launch): step predicted %.4g s, measured %.4g s (%+.0f%%); "
                    "peak GPU predicted %.2f GiB, measured %s%s", self.FIRST, self.last, rep["predicted_step_s"], measured,
                    100 * rep["step_error"], rep["predicted_peak_gpu_bytes"] / GiB, peak_txt,
                    f" (allocated); reserved predicted {reserved / GiB:.2f} GiB" if reserved else "")
        if rep["replanned"]:
            new.predicted["overrides"] = self.overrides
            new.predicted["calibration"] = {k: v for k, v in rep.items() if isinstance(v, (int, float, type(None)))}
            if self.write:
                tmp = self.path + ".tmp"
                new.save(tmp)
                os.replace(tmp, self.path)
            logger.info("offload calibration: off by more than %d%%; re-solved with compute scale %.3g and CPU AdamW "
                        "rate scale %.3g: predicted %.4g s per step. The new plan (%s) is used from the next launch "
                        "of this job on.", 100 * TOLERANCE, fudge, rep["refit_cpu_adam_scale"],
                        new.predicted["step_s"], self.path)
        elif new is not None:
            logger.info("offload calibration: re-solved with compute scale %.3g: the same plan", fudge)
        plain_s = rep.get("predicted_step_without_speculation_s")
        if plain_s is not None and plain_s < measured * (1 - TOLERANCE):
            logger.info("offload calibration: with --offload.speculative_step the CPU AdamW ran at %.2fx the "
                        "profiled rate beside the backward; without it this plan is predicted at %.4g s a step "
                        "against the %.4g s measured: on this host the run is likely faster without the flag",
                        cpu_scale, plain_s, measured)
        return rep


# seconds of sustained work before the first timing (see timer.seconds_per_call)
WARM_S = 1.0


def measure_block_fudges(config, costs_of: dict, prof, seq_len: int, dtype, device: str = "cuda",
                         lora=None, compile_backend: str | None = None) -> dict[int, dict]:
    """Time one real block (fwd, fwd+bwd) at the run's shapes for every candidate micro-batch of
    `costs_of` (the block built once) and compare with the FLOP-based prediction: per micro-batch
    {"fudge": measured / predicted, ...} for `solve(fudge=...)`. GEMMs of 4k rows run well below
    the rate of 32k rows, so one micro-batch's scale misjudges another's. Also times the outer
    (embeddings, final norm, head and the loss as the costs were measured: chunked or not) without
    blocks: "outer_fwd_s", "outer_bwd_s" (`use_block_calibration` puts them into the costs). A
    micro-batch whose one block (fwd+bwd) or outer runs out of GPU memory fits no plan and is left
    out of the result (so are the larger ones). `lora` (the ``[lora]`` section): the block timed
    with its adapters and a frozen base, as the costs were measured. `compile_backend` (the run
    compiles its blocks): the block is also timed compiled, once, at the largest micro-batch that
    fits, and every micro-batch's block times are scaled by compiled / eager ("compile_scale"):
    compiling once per micro-batch would cost a compilation each at startup."""
    import copy

    from transformers import AutoModelForCausalLM

    from flame.models.cpu import prepare_model_build

    prepare_model_build(torch.device(device).type)
    c1 = copy.deepcopy(config)
    c1.num_hidden_layers = 1
    c1.use_cache = False  # a KV cache would chain every timed call's graph to the previous one
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(c1, dtype=dtype)
    if lora is not None:
        from flame.lora import apply_lora
        from flame.lora.layer import init_adapters

        apply_lora(m, lora)
        init_adapters(m)
    blk = m.model.layers[0]
    out = {}
    warm = WARM_S if device == "cuda" else 0.0
    for mb in sorted(costs_of):
        try:
            out[mb] = _time_block(m, blk, costs_of[mb], prof, mb, seq_len, device, warm)
            out[mb].update(_time_outer(m, costs_of[mb], mb, seq_len, device))
            warm = 0.0
        except torch.OutOfMemoryError:
            out.pop(mb, None)
            logger.info("offload: one block at micro-batch %d x %d does not fit the GPU; larger micro-batches "
                        "left out", mb, seq_len)
            break
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    if compile_backend and out:
        mb = max(out)
        try:
            scale, peak = _compile_scale(m, blk, mb, seq_len, device, compile_backend, out[mb]["measured_fwd_bwd_s"])
        except Exception as e:  # a measurement, not the run: the plan can still use the eager times
            logger.warning("offload: timing one compiled block failed (%s: %s); the plan uses eager block times",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            scale, peak = 1.0, None
        # the compiled block saves other tensors than the eager one: its backward peak, measured at
        # one micro-batch, scales the eager peaks of the others by the same ratio
        peak_scale = peak / out[mb]["bwd_peak_bytes"] if peak and out[mb].get("bwd_peak_bytes") else None
        for r in out.values():
            r["compile_scale"] = scale
            for k in ("fudge", "measured_fwd_s", "measured_fwd_bwd_s"):
                r[k] *= scale
            if peak_scale is not None:
                r["eager_bwd_peak_bytes"] = r["bwd_peak_bytes"]
                r["bwd_peak_bytes"] = int(r["bwd_peak_bytes"] * peak_scale)
    del m, blk
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _compile_scale(m, blk, micro_batch: int, seq_len: int, device: str, backend: str,
                   eager_s: float) -> tuple[float, int | None]:
    """Compiled / eager seconds of one block's fwd+bwd at `micro_batch` (compiled as the trainer
    compiles blocks: torch.compile of the block module), and on a GPU the compiled block's
    backward peak (as `_time_block` measures the eager one)."""
    args, kwargs = _block_inputs(m, blk, micro_batch, seq_len, device)
    compiled = torch.compile(blk, backend=backend)

    fwd_bwd = partial(_block_fwd_bwd, compiled, args, kwargs)
    fwd_bwd()  # compiles
    scale = seconds_per_call(fwd_bwd) / eager_s
    peak = _bwd_peak_bytes(blk, fwd_bwd) if device == "cuda" else None
    for p in blk.parameters():
        p.grad = None
    # the model's blocks share this block's code: without a reset their first compilation would
    # count as a recompilation, at a second shape that turns dynamic shapes on (nothing of the run
    # is compiled yet: planning comes before its first forward)
    torch._dynamo.reset()
    logger.info("offload: one compiled block at micro-batch %d x %d runs in %.2fx its eager time; the plan's "
                "block times use that", micro_batch, seq_len, scale)
    return scale, peak


def _bwd_peak_bytes(blk, fwd_bwd) -> int:
    """What one fwd+bwd of `blk` allocates on the GPU above what is already there: a recomputed
    block's backward on top of its input (the recomputed activations, its output and incoming
    gradient, the backward's buffers). Its weight grads are allocated first: the engine's grad
    slots are static memory."""
    for p in blk.parameters():
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _time_outer(m, costs, micro_batch: int, seq_len: int, device: str) -> dict:
    """Time the outer of the one-block model `m` (its blocks taken out) with a grad-enabled forward,
    as training runs it: the chunked loss does its head's backward matmuls and float32 softmax
    passes there, far below GEMM rate."""
    owner, attr, blocks = find_block_list(m, max_classes=1)
    ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device)
    chunk = costs.extra.get("loss_chunk_tokens", 0)
    head = install_chunked_head(m, chunk) if chunk else None

    def loss():
        if head is None:
            logits = m(ids, use_cache=False).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum")
        with chunked_head_loss(head, ids):
            return take_chunked_loss(head, m(ids, use_cache=False).logits)

    def fwd_bwd():
        for p in m.parameters():
            p.grad = None
        loss().backward()

    setattr(owner, attr, nn.ModuleList())
    hook = None
    if not any(p.requires_grad for p in m.parameters()):
        # a frozen outer (a LoRA base): its backward in training is the grad of the hidden states
        # the blocks need (through the head and the final norm), so the embeddings' output takes one
        hook = m.get_input_embeddings().register_forward_hook(lambda mod, a, out: out.detach().requires_grad_(True))
    try:
        tf, tfb = seconds_per_call(loss), seconds_per_call(fwd_bwd)
    finally:
        if hook is not None:
            hook.remove()
        setattr(owner, attr, blocks)
        for p in m.parameters():
            p.grad = None
    return {"outer_fwd_s": tf, "outer_bwd_s": max(tfb - tf, 0.0)}


class _Captured(Exception):
    pass


def _block_fwd_bwd(blk, args: list, kwargs: dict) -> None:
    """One forward and backward of `blk` on its captured inputs (ones as the output's gradient)."""
    o = blk(*args, **kwargs)
    o = o[0] if isinstance(o, (tuple, list)) else o
    o.backward(torch.ones_like(o))


def _block_inputs(m, blk, micro_batch: int, seq_len: int, device: str) -> tuple[list, dict]:
    """`blk`'s (args, kwargs) in `m`'s own forward at micro_batch x seq_len, the hidden states
    made a leaf that takes grads; the rest of the model (the head) is not run."""
    got = {}

    def capture(mod, a, k):
        got.update(a=a, k=k)
        raise _Captured

    h = blk.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            m(torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device), use_cache=False)
    except _Captured:
        pass
    finally:
        h.remove()

    def prep(x):
        return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args = [prep(x) for x in got["a"]]
    kwargs = {k: prep(v) if k == "hidden_states" else v for k, v in got["k"].items() if k != "past_key_values"}
    return args, kwargs


def _time_block(m, blk, costs, prof, micro_batch: int, seq_len: int, device: str, warm_s: float = 0.0) -> dict:
    """Time `blk` (the one block of model `m`) fwd and fwd+bwd at micro_batch x seq_len, on inputs
    captured from `m`'s own forward, against the FLOP-based prediction of `costs`."""
    args, kwargs = _block_inputs(m, blk, micro_batch, seq_len, device)

    def fwd():
        with torch.no_grad():
            blk(*args, **kwargs)

    fwd_bwd = partial(_block_fwd_bwd, blk, args, kwargs)
    tfb = seconds_per_call(fwd_bwd, warm_s=warm_s)
    tf = seconds_per_call(fwd)
    pf, pb = unit_times(costs.layers[0], prof, micro_batch / costs.micro_batch)
    out = {"fudge": tfb / (pf + pb), "measured_fwd_s": tf, "measured_fwd_bwd_s": tfb,
           "predicted_fwd_s": pf, "predicted_fwd_bwd_s": pf + pb}
    if device == "cuda":
        out["bwd_peak_bytes"] = _bwd_peak_bytes(blk, fwd_bwd)
    for p in blk.parameters():
        p.grad = None
    return out
