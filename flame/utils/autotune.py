"""Triton's autotuning of FLA's kernels: shipped results, and a cap on the configs tried.

Shipped results. FLA's kernels choose their launch configs with Triton's autotuner, which (FLA's
default ``FLA_CACHE_RESULTS=1``) keeps each result in Triton's cache as
``<hash>/<kernel>.autotune.json``. The hash covers the Triton build, the GPU target, the kernel's
source, its candidate configs and the tuning key (the head sizes, chunk size and dtypes it was
tuned at), so a result is read only where all of these match. ``seed_autotune_results()`` copies
the results shipped in ``autotune_results/triton-<version>-<target>/`` (measured on an H100 with
the shipped configs; H200 shares the target) into the cache where absent: a cold machine then
compiles one config per kernel instead of every candidate. A shape, Triton or FLA version they do
not cover is autotuned as before; ``FLA_CACHE_RESULTS=0`` turns Triton's cache of results off
altogether. The trainer's setup and ``python -m flame.generate`` seed on a CUDA device.
``python -m flame.utils.autotune export`` (on the GPU, after runs of the configs to ship)
collects a cache's results into that folder.

Cap (a cold-start knob).

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

import logging
import os
import shutil
import sys
from pathlib import Path

from flame.utils.cli import CliParser
from flame.utils.kernel_env import kernel_env

ENV = "FLAME_AUTOTUNE_MAX_CONFIGS"
SHIPPED_RESULTS = Path(__file__).with_name("autotune_results")
RESULT_SUFFIX = ".autotune.json"
logger = logging.getLogger(__name__)


def results_folder(root: Path = SHIPPED_RESULTS) -> Path:
    """The shipped results of this Triton version and GPU target (needs the GPU's driver)."""
    import triton
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return root / f"triton-{triton.__version__}-{target.backend}{target.arch}"


def seed_autotune_results(folder: Path | None = None) -> int:
    """Copy shipped autotuning results into Triton's cache where absent, in the cache's own layout
    (one folder per hash); each file is written whole and renamed into place, so ranks seeding at
    once are safe. Returns how many were added."""
    folder = results_folder() if folder is None else folder
    if not folder.is_dir():
        return 0
    import triton

    cache = Path(triton.knobs.cache.dir)
    added = 0
    for path in sorted(folder.glob(f"*/*{RESULT_SUFFIX}")):
        dest = cache / path.parent.name / path.name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dest)
        added += 1
    return added


def export_autotune_results(cache_dir: Path, out: Path) -> int:
    """Copy every autotuning result under ``cache_dir`` (a Triton cache) into ``out``, one folder
    per hash as in the cache; returns how many."""
    n = 0
    for path in sorted(cache_dir.glob(f"*/*{RESULT_SUFFIX}")):
        dest = out / path.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest / path.name)
        n += 1
    return n


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


def prepare_triton_autotune(device_type: str) -> None:
    """The cap from the environment, and on a CUDA device the shipped results seeded."""
    limit_autotune_from_env()
    if device_type == "cuda":
        try:
            added = seed_autotune_results()
        except OSError as e:  # a speed-up only: a cache folder it cannot write leaves tuning to Triton
            logger.warning("autotune: shipped Triton autotuning results not seeded: %s", e)
            return
        if added:
            logger.info("autotune: %d shipped Triton autotuning results added to the cache (%s)",
                        added, results_folder().name)


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="python -m flame.utils.autotune",
                                     description="Collect a Triton cache's autotuning results into the "
                                                 "folder flame ships for this Triton version and GPU target.")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("--cache", default=None, help="the Triton cache (default: Triton's, TRITON_CACHE_DIR)")
    parser.add_argument("--out", default=str(SHIPPED_RESULTS), help="root of the shipped results")
    args = parser.parse_args(argv)
    import triton

    cache = Path(os.path.expanduser(args.cache or triton.knobs.cache.dir))
    if not cache.is_dir():
        print(f"flame: error: --cache {str(cache)!r}: no such directory", file=sys.stderr)
        return 2
    out = results_folder(Path(os.path.expanduser(args.out)))
    n = export_autotune_results(cache, out)
    print(f"{n} autotuning results from {cache} into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
