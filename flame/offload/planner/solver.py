"""Chooses where every block's state lives: the fastest predicted plan under both budgets.

Search (exact for the cost model, given its placement rule): for identical decoder blocks only
the number of blocks in each mode matters up to placement, so every split
(n_gpu, n_host_opt, n_stream) is enumerated for each outer mode and prefetch depth; for each,
and each count of blocks offloading their activations (`_offload_counts`, only with
offload_activations), the other blocks step down a ladder keep -> selective -> recompute (memory
falls, compute grows along it) and the lowest level that fits the GPU budget is found by
bisection. The memory of a placement and of a set of activation modes are computed apart and
cached: the same activation modes recur in every split. Placement rule (the approximation):
modes and activation modes are spread evenly over the blocks (Bresenham), so streamed blocks
interleave with resident ones and their copies hide behind resident compute. Every candidate's
time comes from `cost_model.predict`. Because the minimum is over a set that only grows with the
GPU budget, more GPU memory never predicts a slower step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict

from flame.errors import ConfigError
from flame.offload.planner.block_costs import ModelCosts
from flame.offload.planner.budgets import reserved_peak_bytes
from flame.offload.planner.cost_model import (DTYPE_BYTES, Dtypes, Prediction, activation_memory, combine_memory,
                                              duplex_shares, host_grad_dtype, offload_bytes, predict, state_memory, unit_times)
from flame.offload.planner.hardware import HardwareProfile
from flame.offload.planner.plan import Plan

GiB = 1024**3


def spread(n: int, counts: dict[str, int]) -> list[str]:
    """Bresenham placement: each label's blocks evenly spaced over n slots."""
    out = [None] * n
    order = sorted(counts.items(), key=lambda kv: kv[1])
    free = list(range(n))
    for label, k in order[:-1]:
        if k <= 0:
            continue
        picks = [free[int((i + 0.5) * len(free) / k)] for i in range(k)]
        for p in picks:
            out[p] = label
        free = [f for f in free if out[f] is None]
    last = order[-1][0]
    return [last if o is None else o for o in out]


_OVERRIDE_VALUES = {"weights": ("mode", {"gpu": "gpu", "host": "stream", "resident": "host_opt"}),
                    "optimizer": ("mode", {"gpu": "gpu", "cpu": "host_opt"}),
                    "activations": ("act", {"keep": "keep", "selective": "selective", "recompute": "recompute",
                                            "offload": "offload", "recompute_host": "recompute_host"})}
_OUTER_MODES = ("gpu", "host_opt")


def _override_error(item: str, why: str) -> ConfigError:
    # a user who separated entries with another character than the comma sees it named
    hint = "; separate entries with commas" if any(c in item for c in ";| ") else ""
    return ConfigError(f"offload.overrides entry {item!r}: {why}{hint}")


def _block_indices(item: str, rng: str, n: int) -> range:
    """The blocks `rng` names (`*`, `i` or `i-j`, inclusive), each within 0..n-1."""
    if rng == "*":
        return range(n)
    a, _, b = rng.partition("-")
    if not (a.strip().isdigit() and (b.strip().isdigit() if "-" in rng else True)):
        raise _override_error(item, "expected a block index `i`, a range `i-j` or `*` in the brackets")
    lo, hi = int(a), int(b) if "-" in rng else int(a)
    if lo > hi:
        raise _override_error(item, f"empty block range {lo}-{hi}")
    if hi >= n:
        raise _override_error(item, f"block index out of 0..{n - 1}")
    return range(lo, hi + 1)


def _parse_overrides(overrides: list[str], n: int) -> dict:
    """`weights[0-3]=gpu`, `optimizer[*]=cpu`, `activations[2]=recompute`, `prefetch=2`, `outer=gpu`."""
    fixed = {"mode": {}, "act": {}}
    glob = {}
    for item in overrides:
        if "=" not in item:
            raise _override_error(item, "expected key=value")
        k, v = item.split("=", 1)
        k, v = k.strip(), v.strip()
        if "[" in k:
            name, rng = k.split("[", 1)
            if not rng.endswith("]") or name not in _OVERRIDE_VALUES or v not in _OVERRIDE_VALUES[name][1]:
                raise _override_error(item, "unknown key or value")
            idx = _block_indices(item, rng[:-1], n)
            kind, vals = _OVERRIDE_VALUES[name]
            for i in idx:
                fixed[kind][i] = vals[v]
        elif k == "prefetch":
            if not v.isdigit():
                raise _override_error(item, "expected prefetch=N, N an integer >= 0")
            glob[k] = int(v)
        elif k == "outer":
            if v not in _OUTER_MODES:
                raise _override_error(item, f"expected outer={' or outer='.join(_OUTER_MODES)}")
            glob[k] = v
        else:
            raise _override_error(item, f"unknown key {k!r}")
    return {"fixed": fixed, "glob": glob}


def _apply(layer_modes, layer_acts, ov):
    for i, m in ov["fixed"]["mode"].items():
        layer_modes[i] = m
    for i, a in ov["fixed"]["act"].items():
        layer_acts[i] = a
    return layer_modes, layer_acts


class HostShortfall(ConfigError):
    """No plan fits the host budget (the GPU budget would hold one): the least host memory a plan
    needs is `need` bytes."""

    def __init__(self, message: str, need: float = math.inf):
        super().__init__(message)
        self.need = need


class GpuShortfall(ConfigError):
    """No plan fits the GPU budget: the least GPU memory a plan needs is `need` bytes."""

    def __init__(self, message: str, need: float):
        super().__init__(message)
        self.need = need


def solve(costs: ModelCosts, prof: HardwareProfile, dt: Dtypes, gpu_budget: int, host_budget: int,
          micro_batch: int, rounds: int, cpu_threads: int, depths=(1, 2, 3), overrides: list[str] | None = None,
          allow_offload: bool = True, fudge: float = 1.0, world: int = 1, node_ranks: int = 1,
          offload_activations: bool = False, selective_recompute: bool = True,
          speculative_step: bool = False, speculative_redo: bool = True, checkpoint_offload: bool = False) -> Plan:
    """The fastest plan whose predicted peak GPU and host bytes fit the budgets
    (`offload_activations`: whether blocks may offload their activations to the host;
    `selective_recompute`: whether blocks may keep their matmul outputs and recompute the rest;
    `speculative_step`: host units' CPU steps start in the backward, see runtime.host_optimizer;
    `speculative_redo`: the run may redo them (a spare master and moments per host unit);
    `checkpoint_offload`: recomputed blocks may keep their inputs in host memory, see runtime.hooks).

    Raises ConfigError naming what is missing when nothing fits (before anything is allocated)."""
    n = len(costs.layers)
    ov = _parse_overrides(overrides or [], n)
    if "prefetch" in ov["glob"]:
        depths = (ov["glob"]["prefetch"],)
    outers = _OUTER_MODES if allow_offload else ("gpu",)
    if "outer" in ov["glob"]:
        outers = (ov["glob"]["outer"],)
    best: tuple[float, Plan] | None = None
    min_gpu = min_host = None
    splits = [(g, h, n - g - h) for g in range(n + 1) for h in range(n + 1 - g)] if allow_offload else [(n, 0, 0)]
    offload_counts = _offload_counts(costs, prof, micro_batch) if allow_offload and offload_activations else [0]
    act_memory = {}
    spare = speculative_step and speculative_redo
    # selective recompute is offered where the measured block keeps less under it than in full
    selective = selective_recompute and all(u.act_select_bytes is not None and u.act_select_bytes < u.act_keep_bytes
                                            for u in costs.layers)
    for g, h, s in splits:
        base_modes, _ = _apply(spread(n, {"gpu": g, "host_opt": h, "stream": s}), ["keep"] * n, ov)
        for outer in outers:
            for depth in depths if s else depths[:1]:
                for acc_group in _acc_options(base_modes, outer, rounds):
                    for outer_acc, accs in acc_group:  # GPU memory grows along a group
                        fits_gpu = False
                        state = state_memory(costs, dt, base_modes, outer, depth, rounds, accs, outer_acc, world,
                                             spare)
                        for o in offload_counts:
                            # o blocks offload their activations; the others step down a ladder
                            # keep -> selective -> recompute (-> recompute_host), one block a level
                            # (memory falls and time grows along it): the lowest level that fits,
                            # by bisection
                            m = n - o
                            top = 2 * m if selective else m  # every block recomputed

                            def at(k, o=o, m=m, top=top):
                                host, k = max(0, k - top), min(k, top)
                                if not selective:
                                    sel, rec = 0, k
                                else:
                                    sel, rec = (k, 0) if k <= m else (2 * m - k, k - m)
                                acts = spread(n, {"offload": o, "recompute_host": host, "recompute": rec - host,
                                                  "selective": sel, "keep": m - rec - sel})
                                return _apply(list(base_modes), acts, ov)

                            def memory(k):
                                acts = at(k)[1]
                                key = (tuple(acts), depth)
                                if key not in act_memory:  # the same activation modes recur in every split
                                    act_memory[key] = activation_memory(costs, dt, acts, depth, micro_batch)
                                return combine_memory(state, act_memory[key])

                            lo, hi = 0, top + (m if checkpoint_offload else 0)
                            m_hi = memory(hi)
                            pg, ph = m_hi.gpu_bytes, m_hi.host_bytes
                            min_gpu = pg if min_gpu is None else min(min_gpu, pg)
                            if pg <= gpu_budget:
                                min_host = ph if min_host is None else min(min_host, ph)
                            fits_gpu = fits_gpu or pg <= gpu_budget
                            if pg > gpu_budget or ph > host_budget:
                                continue
                            while lo < hi:
                                mid = (lo + hi) // 2
                                if memory(mid).gpu_bytes <= gpu_budget:
                                    hi = mid
                                else:
                                    lo = mid + 1
                            modes, acts = at(lo)
                            p = predict(costs, prof, dt, modes, acts, outer, depth, micro_batch, rounds, cpu_threads,
                                        fudge, accs, outer_acc, world, node_ranks, memory(lo), speculative_step,
                                        spare=spare)
                            if best is None or p.step_s < best[0] - 1e-12:
                                plan = Plan(modes, acts, outer, depth, micro_batch, costs.seq_len, rounds, cpu_threads,
                                            asdict(dt), gpu_budget, host_budget,
                                            _pred_dict(p, costs, micro_batch, rounds, prof), layer_gpu_acc=accs,
                                            outer_gpu_acc=outer_acc, world=world, node_ranks=node_ranks,
                                            activation_offload=offload_activations,
                                            selective_recompute=selective_recompute,
                                            speculative_step=speculative_step,
                                            speculative_redo=speculative_redo,
                                            checkpoint_offload=checkpoint_offload,
                                            layer_numel=[u.frozen_numel or u.numel for u in costs.layers])
                                best = (p.step_s, plan)
                            if lo == 0:
                                break  # nothing recomputed: offloading more only adds copies
                        if not fits_gpu:
                            break  # more accumulators only need more
    if best is None:
        if min_gpu is None or min_gpu > gpu_budget:
            least = "every block streamed and recomputed" if allow_offload else \
                "offload.enable off: every block on the GPU, recomputed"
            raise GpuShortfall(f"offload: needs {min_gpu / GiB:.1f} GiB GPU, budget {gpu_budget / GiB:.1f} GiB "
                               f"({least}; --offload.gpu_memory_gib)", min_gpu if min_gpu is not None else math.inf)
        raise HostShortfall(f"offload: needs {min_host / GiB:.1f} GiB host, budget {host_budget / GiB:.1f} GiB "
                            "(--offload.host_memory_gib; 0: the memory available now less --offload.host_margin_gib)",
                            min_host)
    plan = best[1]
    plan.binding = _binding(plan, prof)
    plan.predicted["compute_fudge"] = fudge  # what the calibration refits from
    return plan


def solve_micro_batches(costs_of: dict[int, ModelCosts], step_sequences: int, prof: HardwareProfile, dt: Dtypes,
                        gpu_budget: int, host_budget: int, cpu_threads: int, fudges: dict[int, float] | None = None,
                        shortfall_hints: bool = True, **kw) -> tuple[Plan, ModelCosts]:
    """The fastest plan over micro-batches: `costs_of` maps candidate sequences per micro-batch
    (each dividing `step_sequences`) to their measured costs; rounds = step_sequences / micro-batch,
    so every candidate runs the same tokens per step. `fudges`: each candidate's compute scale
    (measure.calibration.measure_block_fudges; a candidate missing from it is left out), else `fudge` for
    all. A minimum over plans that each only get faster with more GPU memory, so the monotonicity
    of `solve` holds. Raises the smallest candidate's "needs ..." error when none fits; when the
    host is what is short and bf16 optimizer state (master, moments, grads: half the bytes) would
    fit, the error names those options and the host bytes of the plan they give."""
    if fudges is not None and not fudges:
        raise ConfigError(f"offload: one block at micro-batch {min(costs_of)} does not fit in GPU memory "
                          "(its forward+backward ran out of memory when timed)")
    best, best_costs = None, None
    failed: list[tuple[int, ConfigError]] = []  # (micro-batch, why no plan fits it), largest first
    for mb in sorted(costs_of, reverse=True):
        if fudges is not None:
            if mb not in fudges:
                continue
            kw["fudge"] = fudges[mb]
        try:
            plan = solve(costs_of[mb], prof, dt, gpu_budget, host_budget, mb, step_sequences // mb, cpu_threads, **kw)
        except ConfigError as e:
            failed.append((mb, e))
            continue
        if best is None or plan.predicted["step_s"] < best.predicted["step_s"] - 1e-12:
            best, best_costs = plan, costs_of[mb]
    if best is None:
        # the error closest to fitting: the least host memory any micro-batch needs (more rounds
        # need fp32 grads on the host), else the smallest micro-batch's (the last)
        host = [e for _, e in failed if isinstance(e, HostShortfall)]
        missing = min(host, key=lambda e: e.need) if host else failed[-1][1]
        gpu_short = {mb: e.need for mb, e in failed if isinstance(e, GpuShortfall)}
        if shortfall_hints and isinstance(missing, HostShortfall):
            hints = _host_shortfall_hints(costs_of, step_sequences, prof, dt, gpu_budget, host_budget, cpu_threads,
                                          fudges, kw)
            if gpu_short:
                # a larger micro-batch (fewer rounds: less host memory) that only lacked GPU memory
                mb = min(gpu_short, key=gpu_short.get)
                hints.append(f"micro-batch {mb} ({step_sequences // mb} round(s) a step) needs "
                             f"{gpu_short[mb] / GiB:.1f} GiB GPU (--offload.gpu_memory_gib)")
            if hints:
                raise HostShortfall(f"{missing}; {'; '.join(hints)}", missing.need) from None
        raise missing
    return best, best_costs


def _host_shortfall_hints(costs_of, step_sequences, prof, dt, gpu_budget, host_budget, cpu_threads, fudges,
                          kw) -> list[str]:
    """The options that would make a plan fit a host budget nothing fits now, each with the host
    bytes of the plan it gives: without the speculative step (no spare master and moments; the
    same numerics), without clipping and NaN skipping (the speculation in place), then bf16 optimizer state (master, moments, grads: half the bytes)."""
    def host_gib(dtypes, **changes) -> float | None:
        try:
            # a variant that does not fit either needs no hints of its own
            plan, _ = solve_micro_batches(costs_of, step_sequences, prof, dtypes, gpu_budget, host_budget,
                                          cpu_threads, fudges, shortfall_hints=False, **{**kw, **changes})
        except ConfigError:
            return None
        return plan.predicted["peak_host_bytes"] / GiB

    hints = []
    if kw.get("speculative_step") and kw.get("speculative_redo", True):
        gib = host_gib(dt, speculative_step=False)
        if gib is not None:
            hints.append(f"without --offload.speculative_step (its spare master and moments) it plans {gib:.1f} GiB")
        gib = host_gib(dt, speculative_redo=False)
        if gib is not None:
            hints.append(f"with --training.max_norm 0 --training.no-skip_nan_inf (no step to redo: the speculative "
                         f"step needs no spare) it plans {gib:.1f} GiB")
    wide = [name for name in ("master", "moment", "grad") if DTYPE_BYTES[getattr(dt, name)] > 2]
    if wide:
        gib = host_gib(dataclasses.replace(dt, **{name: "bfloat16" for name in wide}))
        if gib is not None:
            options = " ".join(f"--offload.{name}_dtype bfloat16" for name in wide)
            hints.append(f"with bf16 optimizer state ({options}) it plans {gib:.1f} GiB")
    return hints


def _offload_counts(costs: ModelCosts, prof: HardwareProfile, micro_batch: int) -> list[int]:
    """How many blocks the solver tries offloading activations for (each count's blocks spread
    evenly). Offloading replaces recomputing a block's forward with its saved bytes crossing PCIe
    each way. Past the count whose D2H fills the whole forward's compute, every further block
    adds more link time than the recompute it saves, so counts stop there: a ladder of n/8 steps
    up to that cap (a fixed set for a model and micro-batch: larger budgets never lose an option)."""
    layers = costs.layers
    n = len(layers)
    if not n:
        return [0]
    scale = micro_batch / costs.micro_batch
    u = layers[0]
    fwd = unit_times(u, prof, scale)[0]
    d2h = scale * offload_bytes(u) / duplex_shares(prof)[1]
    cap = n if d2h <= 0 else min(n, math.ceil(n * fwd / d2h))
    step = max(1, n // 8)
    return sorted(set(range(0, cap + 1, step)) | {cap})


def _acc_options(modes: list[str], outer: str, rounds: int) -> list[list[tuple[bool, list[bool]]]]:
    """GPU grad accumulation choices (outer, per block), in groups of growing GPU memory: with and
    without the outer, for a fixed ladder of counts of host blocks (spread evenly). A fixed set,
    so that a larger budget never loses an option (monotone plans)."""
    host = [i for i, m in enumerate(modes) if m != "gpu"]
    if rounds == 1 or (not host and outer == "gpu"):
        return [[(False, [])]]
    step = max(1, -(-len(host) // 8))
    counts = sorted(set(range(0, len(host), step)) | {len(host)})
    groups = []
    for outer_acc in (False, True) if outer != "gpu" else (False,):
        group = []
        for a in counts:
            accs = [False] * len(modes)
            for i, label in zip(host, spread(len(host), {"acc": a, "host": len(host) - a}) if host else []):
                accs[i] = label == "acc"
            group.append((outer_acc, accs))
        groups.append(group)
    return groups


def _pred_dict(p: Prediction, costs: ModelCosts, micro_batch: int, rounds: int, prof: HardwareProfile) -> dict:
    tokens = micro_batch * costs.seq_len * rounds
    peak = prof.gemm_rate("8192x8192x8192") if "8192x8192x8192" in prof.gemm_tflops else prof.gemm_rate()
    return {"step_s": p.step_s, "tokens_per_s": tokens / p.step_s, "mfu": p.useful_flops / p.step_s / peak,
            "useful_tflops": p.useful_flops / p.step_s / 1e12,
            "peak_gpu_bytes": p.gpu_bytes, "peak_gpu_reserved_bytes": reserved_peak_bytes(p.gpu_bytes),
            "peak_host_bytes": p.host_bytes, "pinned_bytes": p.pinned_bytes,
            "compute_s": p.compute_s, "h2d_bytes": p.h2d_bytes, "d2h_bytes": p.d2h_bytes, "cpu_opt_s": p.cpu_s,
            "static_gpu_bytes": p.static_gpu, "activation_bytes": p.activation_bytes, "transient_bytes": p.transient_bytes,
            "phase_s": p.phase_s}


def _binding(plan: Plan, prof: HardwareProfile) -> str:
    pr = plan.predicted
    if not plan.offloads:
        return "none (everything resident)"
    if pr["peak_gpu_bytes"] > 0.97 * plan.gpu_budget_bytes or any(a == "recompute" for a in plan.layer_acts):
        what = "GPU memory budget"
    elif pr["peak_host_bytes"] > 0.97 * plan.host_budget_bytes:
        what = "host memory budget"
    else:  # the budgets leave room: offloading is predicted no slower than keeping
        what = "no budget (the offloaded plan is the fastest predicted)"
    bound = max(("compute", pr["compute_s"]), ("H2D/D2H link", (pr["h2d_bytes"] + pr["d2h_bytes"]) / (prof.duplex_gbps * 1e9)),
                ("CPU optimizer", pr["cpu_opt_s"]), key=lambda kv: kv[1])[0]
    return f"{what}; step bound by {bound}"


def host_grads_note(plan: Plan, costs: ModelCosts) -> str:
    """Where host units' grads are kept in another dtype than `grad` (cost_model.host_grad_dtype)."""
    host = host_grad_dtype(Dtypes(**plan.dtypes), plan.rounds)
    units = zip([costs.outer] + list(costs.layers), [plan.outer_mode] + list(plan.layer_modes))
    trained_on_host = any(m != "gpu" and u.trainable_numel for u, m in units)
    return f" (host grads kept in {host}: one micro-batch a step, nothing to sum)" \
        if trained_on_host and host != plan.dtypes["grad"] else ""


def describe(plan: Plan, costs: ModelCosts) -> str:
    """Human-readable plan: one line per run of equal block decisions, then the prediction."""
    pr = plan.predicted
    accs = plan.unit_accs()
    lines = [f"offload plan: {len(plan.layer_modes)} blocks ({costs.layer_class}), micro-batch {plan.micro_batch}x{plan.seq_len}, "
             f"{plan.rounds} round(s)/step, prefetch depth {plan.prefetch_depth}, CPU threads {plan.cpu_threads}"
             + (f", host state sharded over {plan.world} ranks (bytes per rank)" if plan.world > 1 else ""),
             f"  dtypes: {plan.dtypes}" + host_grads_note(plan, costs),
             f"  outer (embeddings/norm/head, {costs.outer.numel / 1e6:.0f}M params"
             + (f" with the adapters, {costs.outer.trainable_numel / 1e6:.0f}M trainable" if costs.outer.frozen_numel else "")
             + f"): {plan.outer_mode}"
             + ("; grads accumulated on GPU" if accs[0] else "")]
    names = {"gpu": "weights+grads+AdamW on GPU", "host_opt": "weights on GPU, grads->host, CPU AdamW",
             "stream": "weights streamed from pinned host, grads->host, CPU AdamW"}
    key = list(zip(plan.layer_modes, plan.layer_acts, accs[1:]))
    i, n = 0, len(plan.layer_modes)
    while i < n:
        j = i
        while j + 1 < n and key[j + 1] == key[i]:
            j += 1
        acc = "; grads accumulated on GPU (->host once a step)" if accs[i + 1] else ""
        mode = plan.layer_modes[i]
        what = (("weights on GPU" if mode != "stream" else "weights streamed from pinned host") + ", frozen"
                if all(u.trainable_numel == 0 for u in costs.layers[i:j + 1]) else names[mode])
        lines.append(f"  blocks {i}-{j}: {what}; activations {plan.layer_acts[i]}{acc}")
        i = j + 1
    c = {m: plan.layer_modes.count(m) for m in ("gpu", "host_opt", "stream")}
    lines.append(f"  counts: {c}, recomputed {plan.layer_acts.count('recompute')}, recomputed with inputs on the "
                 f"host {plan.layer_acts.count('recompute_host')}, selectively recomputed "
                 f"{plan.layer_acts.count('selective')}, activations offloaded {plan.layer_acts.count('offload')}, "
                 f"GPU grad accumulators {sum(accs[1:])}")
    if plan.speculative_step:
        units = zip([plan.outer_mode, *plan.layer_modes], [costs.outer, *costs.layers])
        if any(m != "gpu" and u.trainable_numel for m, u in units):
            lines.append("  CPU AdamW: speculative (each host block steps as its grads land in the backward; "
                         + ("into spare buffers, redone on clipped steps)" if plan.speculative_redo else
                            "in place: no clipping or skipping can undo it)"))
        else:
            lines.append("  CPU AdamW: none (every trained parameter steps on the GPU): speculative_step has no effect")
    lines.append(f"  predicted step {pr['step_s'] * 1e3:.1f} ms, {pr['tokens_per_s']:.0f} tokens/s, MFU {100 * pr['mfu']:.1f}% "
                 f"({pr['useful_tflops']:.0f} TFLOP/s useful)")
    reserved = pr.get("peak_gpu_reserved_bytes")
    lines.append(f"  peak GPU {pr['peak_gpu_bytes'] / GiB:.2f} GiB of {plan.gpu_budget_bytes / GiB:.2f}"
                 + (f" allocated, {reserved / GiB:.2f} reserved" if reserved else "") + "; host "
                 f"{pr['peak_host_bytes'] / GiB:.2f} GiB of {plan.host_budget_bytes / GiB:.2f} (pinned {pr['pinned_bytes'] / GiB:.2f})")
    lines.append(f"  binding constraint: {plan.binding}")
    return "\n".join(lines)
