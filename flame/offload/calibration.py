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
