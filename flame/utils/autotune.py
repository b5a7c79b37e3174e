"""Cap how many configs Triton's autotuner compiles and times per kernel (cold-start knob).

FLA's chunk kernels autotune over dozens of configs each; on a machine with an empty Triton
cache the first backward of a GLA/GatedDeltaNet model spends many minutes in ptxas (more than ten
for a GLA 340M on an H100). ``FLAME_AUTOTUNE_MAX_CONFIGS=k`` keeps k
configs per kernel, spread evenly over the kernel's own list (its first and last included), so a
cold start compiles k instead of all; the autotuner still times those k and skips any that do
not fit the GPU. Kernels may then run slower than fully tuned ones: use it for smoke runs and
short jobs, not for speed measurements. Off (0) by default. The trainer's setup and
``python -m flame.generate`` read the variable (``import flame`` does not).
"""

from __future__ import annotations

from flame.utils.kernel_env import kernel_env

ENV = "FLAME_AUTOTUNE_MAX_CONFIGS"


def spread_pick(items: list, k: int) -> list:
    """k items evenly spaced over `items` (all when k >= len), first and last included for k >= 2."""
    n = len(items)
    if k >= n:
        return list(items)
    if k == 1:
        return [items[0]]
    return [items[round(i * (n - 1) / (k - 1))] for i in range(k)]


def limit_autotune(k: int) -> None:
    """Patch triton's Autotuner so that every autotuned kernel considers at most k configs."""
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner.prune_configs, "_flame_limit", None) == k:
        return
    base = getattr(Autotuner.prune_configs, "_flame_base", Autotuner.prune_configs)

    def prune_configs(self, kwargs):
        return spread_pick(base(self, kwargs), k)

    prune_configs._flame_limit = k
    prune_configs._flame_base = base
    Autotuner.prune_configs = prune_configs


def limit_autotune_from_env() -> None:
    k = int(kernel_env(ENV))
    if k:
        limit_autotune(k)
