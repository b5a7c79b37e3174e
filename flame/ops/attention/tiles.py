"""Launch tiles of flame's attention kernels: candidates, and the choice cached once per machine.

A tile is picked per ``TileKey`` (kernel, mode, padded head dim, dtype, GQA group, dense/varlen,
power-of-two bucket of the longest sequence) in this order:

1. this process's memo;
2. the on-disk cache: one JSON per (GPU name, flame version, triton version) under
   ``$FLAME_AUTOTUNE_CACHE`` (a directory), else ``$XDG_CACHE_HOME/flame/autotune`` or
   ``~/.cache/flame/autotune``;
3. the defaults shipped in ``tuned_tiles.json`` for the GPU name;
4. timing every candidate with ``triton.testing.do_bench``; the winner goes to the disk cache.

``FLAME_ATTN_AUTOTUNE``: ``1`` (default) as above; ``0`` never times (memo, disk, shipped, then the
first candidate); ``force`` skips disk and shipped tiles and times again (once per process), which
refreshes the disk cache. Writers merge their entries into the JSON under an exclusive ``flock``
and replace it atomically, so concurrent processes lose no entry; an unreadable file is ignored
with one warning.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from flame.utils.cache_dir import cache_dir as user_cache_dir
from flame.utils.kernel_env import kernel_env

logger = logging.getLogger(__name__)

SHIPPED_FILE = Path(__file__).with_name("tuned_tiles.json")
MIN_SEQLEN_BUCKET = 1024   # shorter sequences share one class: their launches are small either way


class TileConfig(NamedTuple):
    outer: int        # rows owned by one program (queries for fwd/dq, keys for dk/dv)
    inner: int        # tile length of the loop dimension (must divide ``outer``)
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TileKey:
    """The shape class a tile is chosen for."""

    kernel: str        # "fwd", "dkdv" or "dq"
    mode: str          # "softmax", "softpick" or "rectified"
    head_dim: int      # padded (power of two) head dim
    dtype: str         # e.g. "bfloat16"
    group: int         # query heads per key head
    varlen: bool
    seqlen_bucket: int  # next power of two of the longest sequence, at least MIN_SEQLEN_BUCKET

    def name(self) -> str:
        layout = "varlen" if self.varlen else "dense"
        return f"{self.kernel}/{self.mode}/d{self.head_dim}/{self.dtype}/g{self.group}/{layout}/t{self.seqlen_bucket}"


def seqlen_bucket(max_seqlen: int) -> int:
    return max(MIN_SEQLEN_BUCKET, 1 << max(0, math.ceil(math.log2(max(1, max_seqlen)))))


# Candidate tiles per kernel and padded head dim; the first entry is the untuned default.
# _MODE_TILES overrides a (kernel, mode, head dim) where one mode prefers other tiles (softpick's
# backward holds more live values per element). Head dim 128 ordered by an H100 sweep
# (benchmarks/attention_tiles.py, B=4 T=4096 H=16 bf16).
_FWD = {
    64: [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3),
         TileConfig(128, 64, 8, 4), TileConfig(128, 32, 4, 3), TileConfig(64, 64, 4, 4), TileConfig(128, 128, 8, 2)],
    128: [TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3)],
    256: [TileConfig(64, 32, 4, 2), TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2)],
}
_DKDV = {
    64: [TileConfig(128, 64, 8, 3), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(64, 64, 4, 3),
         TileConfig(64, 64, 4, 2), TileConfig(128, 64, 8, 2), TileConfig(128, 128, 8, 2), TileConfig(128, 64, 4, 3),
         TileConfig(64, 32, 4, 4)],
    128: [TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 2)],
    256: [TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 16, 4, 2)],
}
_DQ = {
    64: [TileConfig(128, 64, 8, 3), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(64, 64, 4, 3),
         TileConfig(64, 32, 4, 4), TileConfig(128, 64, 8, 2)],
    128: [TileConfig(128, 64, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(128, 128, 8, 2)],
    256: [TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 16, 4, 2)],
}
_TILES = {"fwd": _FWD, "dkdv": _DKDV, "dq": _DQ}
_MODE_TILES: dict[tuple[str, str, int], list[TileConfig]] = {
    ("fwd", "softpick", 128): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)],
    ("dkdv", "softpick", 128): [TileConfig(64, 32, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2),
                                TileConfig(64, 64, 4, 2)],
    ("dkdv", "rectified", 128): [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2),
                                 TileConfig(64, 32, 4, 3)],
}


def candidates(kernel: str, mode: str, head_dim: int) -> list[TileConfig]:
    cls = 64 if head_dim <= 64 else (128 if head_dim <= 128 else 256)
    return _MODE_TILES.get((kernel, mode, cls)) or _TILES[kernel][cls]


# ---- versions, device, locations --------------------------------------------------------------

def flame_version() -> str:
    from flame import __version__

    return __version__


def triton_version() -> str:
    import triton

    return triton.__version__


def device_name(device=None) -> str:
    import torch

    return torch.cuda.get_device_name(device)


def cache_dir() -> Path:
    return user_cache_dir("autotune", "FLAME_AUTOTUNE_CACHE")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "_", text.lower()).strip("_")


def cache_path(device: str, flame_ver: str, triton_ver: str, directory: Path | None = None) -> Path:
    """The cache file of one GPU name and flame / triton version."""
    directory = cache_dir() if directory is None else Path(directory)
    return directory / f"{_slug(device)}__flame-{_slug(flame_ver)}__triton-{_slug(triton_ver)}.json"


# ---- reading and writing ----------------------------------------------------------------------

_WARNED: set[str] = set()


def _warn_once(path: Path, what: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(f"flame attention tile cache {path}: {what}; ignoring it", RuntimeWarning, stacklevel=3)


def _parse_tiles(raw, path: Path) -> dict[str, TileConfig]:
    out = {}
    try:
        for name, entry in raw.items():
            tile = entry["tile"] if isinstance(entry, dict) else entry
            if len(tile) != 4 or not all(isinstance(x, int) and x > 0 for x in tile):
                raise ValueError(f"bad tile {tile!r} for {name}")
            out[str(name)] = TileConfig(*tile)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        _warn_once(path, f"malformed ({e})")
        return {}
    return out


def _read_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _warn_once(path, f"unreadable ({type(e).__name__}: {e})")
        return None


def load_cache(path: Path) -> dict[str, TileConfig]:
    data = _read_json(path)
    if data is None:
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("tiles"), dict):
        _warn_once(path, "no 'tiles' object")
        return {}
    return _parse_tiles(data["tiles"], path)


def store_entry(path: Path, name: str, tile: TileConfig, ms: float | None, meta: dict) -> None:
    """Merge one entry into the cache file (exclusive lock, temp file + atomic replace)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("tiles"), dict):
            data = {}
        data.update(meta)
        tiles = data.setdefault("tiles", {})
        tiles[name] = {"tile": list(tile), "ms": ms}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def shipped_tiles(device: str, path: Path = SHIPPED_FILE) -> dict[str, TileConfig]:
    data = _read_json(path)
    if not isinstance(data, dict):
        return {}
    entry = data.get("devices", {}).get(device)
    if not isinstance(entry, dict):
        return {}
    return _parse_tiles(entry.get("tiles", {}), path)


# ---- choice -----------------------------------------------------------------------------------

_MEMO: dict[tuple[str, TileKey], TileConfig] = {}
_DISK: dict[Path, dict[str, TileConfig]] = {}     # files read by this process
_SHIPPED: dict[str, dict[str, TileConfig]] = {}


def tuned_configs() -> dict[str, str]:
    """The tiles picked so far in this process (for benchmark reports)."""
    return {key.name(): str(tuple(tile)) for (_, key), tile in _MEMO.items()}


def autotune_mode() -> str:
    return kernel_env("FLAME_ATTN_AUTOTUNE")


# milliseconds of repeated launches timed per candidate: short at a run's first use of a shape,
# longer in ``python -m flame.ops.attention.tune`` (its winners are shipped)
TIMING_REP_MS = 10


def time_launch(launch: Callable[[], None]) -> float:
    """Milliseconds per launch (replaced by a fake timer in CPU tests)."""
    from triton.testing import do_bench

    return do_bench(launch, warmup=3, rep=TIMING_REP_MS)


def tune(configs: list[TileConfig], launch: Callable[[TileConfig], None]) -> tuple[TileConfig, float | None]:
    """The fastest of ``configs`` and its time; tiles that fail to launch (e.g. too much shared
    memory on this GPU) are skipped."""
    best, best_ms = configs[0], math.inf
    for c in configs:
        try:
            ms = time_launch(lambda c=c: launch(c))
        except Exception as e:  # noqa: BLE001  (a tile this GPU cannot run)
            logger.debug(f"tile {tuple(c)} failed: {type(e).__name__}: {e}")
            continue
        if ms < best_ms:
            best, best_ms = c, ms
    return best, (best_ms if math.isfinite(best_ms) else None)


def choose(key: TileKey, configs: list[TileConfig], launch: Callable[[TileConfig], None], device: str) -> TileConfig:
    """The tile for ``key`` on ``device`` (see the module docstring for the order)."""
    memo_key = (device, key)
    tile = _MEMO.get(memo_key)
    if tile is not None:
        return tile
    mode = autotune_mode()
    name = key.name()
    path = cache_path(device, flame_version(), triton_version())
    if mode != "force":
        if path not in _DISK:
            _DISK[path] = load_cache(path)
        tile = _DISK[path].get(name)
        if tile is None:
            if device not in _SHIPPED:
                _SHIPPED[device] = shipped_tiles(device)
            tile = _SHIPPED[device].get(name)
    if tile is None:
        if mode == "0" or len(configs) == 1:
            tile = configs[0]
        else:
            tile, ms = tune(configs, launch)
            logger.info(f"attention tiles {name} on {device}: {tuple(tile)} ({ms} ms)")
            meta = {"device": device, "flame": flame_version(), "triton": triton_version()}
            try:
                store_entry(path, name, tile, ms, meta)
                _DISK.setdefault(path, {})[name] = tile
            except OSError as e:
                _warn_once(path, f"not writable ({e})")
    _MEMO[memo_key] = tile
    return tile
