"""Refitting the planner with measurements: a plan's prediction against a measured step (compare),
the CPU AdamW rate and compute scale refit from it and the plan solved again (refit), the plan
an earlier launch's calibration wrote (calibrated_plan_for), and the block calibration's timings
put into the costs (use_block_calibration). The measuring is `flame.offload.measure.calibration`.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from flame.offload.planner.cost_model import Dtypes, predict, shard_numel
from flame.offload.planner.plan import Plan
from flame.offload.planner.solver import solve

logger = logging.getLogger(__name__)

TOLERANCE = 0.10
CALIBRATED_PLAN = "offload_plan_calibrated.json"


def compare(plan: Plan, measured_step_s: float, measured_peak_bytes: int | None) -> dict:
    pr = plan.predicted
    out = {
        "predicted_step_s": pr["step_s"], "measured_step_s": measured_step_s,
        "step_error": measured_step_s / pr["step_s"] - 1.0,
        "predicted_peak_gpu_bytes": pr["peak_gpu_bytes"], "measured_peak_gpu_bytes": measured_peak_bytes,
    }
    if measured_peak_bytes is not None:
        out["peak_error"] = measured_peak_bytes / pr["peak_gpu_bytes"] - 1.0
    return out


def cpu_adam_scale(plan: Plan, costs, prof, cpu_adam_s: float) -> float:
    """Measured over profiled CPU AdamW rate: the seconds the plan's host units should take at the
    profile's rate over the seconds the engine measured for them (its host_seconds["cpu_adam"]
    per step). The profile's rate is a micro-benchmark; the engine's timing is what its steps saw."""
    units = [costs.outer] + list(costs.layers)
    modes = [plan.outer_mode] + list(plan.layer_modes)
    params = sum(shard_numel(u.numel, plan.world) for u, m in zip(units, modes) if m != "gpu")
    if not params or cpu_adam_s <= 0:
        return 1.0
    return params / prof.cpu_adam_rate(plan.cpu_threads, plan.node_ranks, plan.dtypes["master"]) / cpu_adam_s


def with_cpu_adam_scale(prof, scale: float):
    """The profile with every CPU AdamW rate (each states dtype) multiplied by `scale`."""
    return dataclasses.replace(prof, cpu_adam_gparams={k: v * scale for k, v in prof.cpu_adam_gparams.items()},
                               cpu_adam_bf16_gparams={k: v * scale for k, v in prof.cpu_adam_bf16_gparams.items()})


def predict_again(plan: Plan, costs, prof, fudge: float):
    """The plan's decisions predicted again with another profile or compute scale."""
    return predict(costs, prof, Dtypes(**plan.dtypes), plan.layer_modes, plan.layer_acts, plan.outer_mode,
                   plan.prefetch_depth, plan.micro_batch, plan.rounds, plan.cpu_threads, fudge, plan.layer_gpu_acc,
                   plan.outer_gpu_acc, world=plan.world, node_ranks=plan.node_ranks, speculative=plan.speculative_step,
                   spare=plan.speculative_step and plan.speculative_redo)


def without_speculation(plan: Plan, costs, prof) -> float:
    """The step the same plan is predicted to take without the speculative step: its CPU AdamW
    after the backward at the profile's rate, with the plan's compute scale. The calibration sets
    it beside a speculative plan's measured step: speculation pays only where the CPU AdamW keeps
    its rate while the backward runs beside it."""
    return predict_again(dataclasses.replace(plan, speculative_step=False), costs, prof,
                         plan.predicted.get("compute_fudge", 1.0)).step_s


def refit(plan: Plan, costs, prof, measured_step_s: float, overrides=None,
          depths=(1, 2, 3), cpu_rate_scale: float = 1.0) -> tuple[float, Plan | None]:
    """(refit compute scale, new plan or None when the step is within tolerance).

    With `cpu_rate_scale` (cpu_adam_scale of the engine's measured CPU AdamW time) other than 1,
    the CPU rate is refit first and the plan predicted again; what is left of the error goes to
    the compute scale (the blocks': a unit timed before the run keeps its times, so the refit
    predicts somewhat short of the measured step)."""
    pr = plan.predicted
    fudge = pr.get("compute_fudge", 1.0)
    predicted = pr["step_s"]
    if cpu_rate_scale != 1.0:
        prof = with_cpu_adam_scale(prof, cpu_rate_scale)
        predicted = predict_again(plan, costs, prof, fudge).step_s
    ratio = measured_step_s / predicted
    fudge *= ratio
    if abs(measured_step_s / pr["step_s"] - 1.0) <= TOLERANCE:
        return fudge, None
    dt = Dtypes(**plan.dtypes)
    new = solve(costs, prof, dt, plan.gpu_budget_bytes, plan.host_budget_bytes, plan.micro_batch, plan.rounds,
                plan.cpu_threads, depths, overrides=overrides, fudge=fudge, world=plan.world,
                node_ranks=plan.node_ranks, offload_activations=plan.activation_offload,
                selective_recompute=plan.selective_recompute, speculative_step=plan.speculative_step,
                speculative_redo=plan.speculative_redo, checkpoint_offload=plan.checkpoint_offload)
    return fudge, new


def same_decisions(a: Plan, b: Plan) -> bool:
    return (a.layer_modes, a.layer_acts, a.outer_mode, a.prefetch_depth, a.unit_accs()) == \
        (b.layer_modes, b.layer_acts, b.outer_mode, b.prefetch_depth, b.unit_accs())


def calibrated_plan_for(dump_folder: str, reference: Plan, overrides) -> Plan | None:
    """The plan a calibration of an earlier launch wrote, if it was made for what `reference`
    (this launch's plan) was made for (dtypes, micro-batch, rounds, ranks, CPU threads, blocks and their parameters,
    overrides, the solver's options and the speculative step's kind) and its predicted peaks fit
    this launch's budgets. None otherwise (the fresh plan is used)."""
    path = os.path.join(dump_folder, CALIBRATED_PLAN)
    if not os.path.isfile(path):
        return None
    plan = Plan.load(path)
    # a resumed launch may change the offload options or clipping: the engine executes the plan's
    key = ("dtypes", "micro_batch", "seq_len", "rounds", "world", "node_ranks", "cpu_threads", "activation_offload",
           "selective_recompute", "speculative_step", "checkpoint_offload", "layer_numel")
    # budgets: the default host budget follows the free memory of the moment, so the plan only
    # has to fit this launch's budgets
    if any(getattr(plan, k) != getattr(reference, k) for k in key) or \
            (plan.speculative_step and plan.speculative_redo != reference.speculative_redo) or \
            len(plan.layer_modes) != len(reference.layer_modes) or \
            plan.predicted.get("overrides", []) != list(overrides or []) or \
            plan.predicted["peak_gpu_bytes"] > reference.gpu_budget_bytes or \
            plan.predicted["peak_host_bytes"] > reference.host_budget_bytes:
        logger.info("offload: %s was made for other settings; not used", path)
        return None
    return plan



def use_block_calibration(costs_of: dict, cals: dict) -> dict[int, float]:
    """Put measure_block_fudges' outer times (and, from a GPU, the blocks' measured backward peak)
    into the costs of each micro-batch it timed; returns the blocks' compute scale per micro-batch
    (solve_micro_batches' `fudges`)."""
    for mb, c in cals.items():
        costs = costs_of[mb]
        costs.outer.timed_s = [c["outer_fwd_s"], c["outer_bwd_s"]]
        if c.get("bwd_peak_bytes"):  # measured on a GPU: for every block built like the one timed
            for u in costs.layers:
                if u.param_roles == costs.layers[0].param_roles:
                    u.bwd_peak_bytes = c["bwd_peak_bytes"]
    return {mb: c["fudge"] for mb, c in cals.items()}
