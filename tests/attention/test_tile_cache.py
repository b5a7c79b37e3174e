"""The attention tile choice: keys, the on-disk cache, shipped defaults, concurrent writers, bad files.

CPU only: launches are no-ops and a fake timer gives each tile a fresh random time, so the fastest
tile is known to the test and differs from the untuned default.
"""
import json
import multiprocessing
import os
import random
import threading

import pytest

from flame.errors import ConfigError
from flame.ops.attention import tiles
from flame.ops.attention.tiles import TileConfig, TileKey

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = "Fake GPU 80GB"


@pytest.fixture(autouse=True)
def fresh_state(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAME_AUTOTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLAME_ATTN_AUTOTUNE", raising=False)
    forget_process_state(monkeypatch)
    monkeypatch.setattr(tiles, "_WARNED", set())
    monkeypatch.setattr(tiles, "triton_version", lambda: "3.6.0")


def forget_process_state(monkeypatch):
    """As a new process would start: nothing in memory, only files."""
    monkeypatch.setattr(tiles, "_MEMO", {})
    monkeypatch.setattr(tiles, "_DISK", {})
    monkeypatch.setattr(tiles, "_SHIPPED", {})


class FakeTimer:
    """Random ms per tile; counts timings. ``launch`` records the tile it was given."""

    def __init__(self, configs):
        self.ms = {c: random.uniform(0.5, 2.0) for c in configs}
        self.timed = 0
        self.last = None

    def launch(self, tile):
        self.last = tile

    def time(self, fn):
        fn()
        self.timed += 1
        return self.ms[self.last]

    def fastest(self):
        return min(self.ms, key=self.ms.get)


def key(**kw):
    base = dict(kernel="fwd", mode="softpick", head_dim=64, dtype="bfloat16", group=1, varlen=False,
                seqlen_bucket=4096)
    base.update(kw)
    return TileKey(**base)


def choose(monkeypatch, k, device=GPU):
    configs = tiles.candidates(k.kernel, k.mode, k.head_dim)
    timer = FakeTimer(configs)
    while timer.fastest() == configs[0]:  # the tuned choice must differ from the untuned default
        timer = FakeTimer(configs)
    monkeypatch.setattr(tiles, "time_launch", timer.time)
    return tiles.choose(k, configs, timer.launch, device), timer


def test_tune_once_then_disk_cache(monkeypatch):
    k = key()
    tile, timer = choose(monkeypatch, k)
    assert tile == timer.fastest() and timer.timed == len(timer.ms)
    # same process: memo; new process: the disk cache, no timing
    again, timer2 = choose(monkeypatch, k)
    assert again == tile and timer2.timed == 0
    forget_process_state(monkeypatch)
    again, timer3 = choose(monkeypatch, k)
    assert again == tile and timer3.timed == 0
    path = tiles.cache_path(GPU, tiles.flame_version(), "3.6.0")
    assert path.parent == tiles.cache_dir() and json.loads(path.read_text())["tiles"][k.name()]["tile"] == list(tile)


@pytest.mark.parametrize("change", ["device", "triton", "flame", "dtype", "varlen", "bucket", "group"])
def test_key_parts_separate_entries(monkeypatch, change):
    k = key()
    choose(monkeypatch, k)
    forget_process_state(monkeypatch)
    device = GPU
    if change == "device":
        device = "Other GPU"
    elif change == "triton":
        monkeypatch.setattr(tiles, "triton_version", lambda: "3.7.0")
    elif change == "flame":
        monkeypatch.setattr(tiles, "flame_version", lambda: "9.9.9")
    else:
        field = {"dtype": ("dtype", "float16"), "varlen": ("varlen", True), "bucket": ("seqlen_bucket", 8192),
                 "group": ("group", 4)}[change]
        k = key(**{field[0]: field[1]})
    _, timer = choose(monkeypatch, k, device)
    assert timer.timed == len(timer.ms), f"a {change} change must not reuse the cached tile"


def test_seqlen_bucket():
    assert tiles.seqlen_bucket(1) == tiles.seqlen_bucket(1024) == 1024
    assert tiles.seqlen_bucket(1025) == tiles.seqlen_bucket(2048) == 2048
    assert tiles.seqlen_bucket(4000) == 4096


def test_store_and_load_round_trip(tmp_path):
    path = tmp_path / "x" / "c.json"
    tiles.store_entry(path, "a", TileConfig(64, 32, 4, 3), 1.5, {"device": GPU})
    tiles.store_entry(path, "b", TileConfig(128, 64, 8, 2), None, {"device": GPU})
    assert tiles.load_cache(path) == {"a": TileConfig(64, 32, 4, 3), "b": TileConfig(128, 64, 8, 2)}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_shipped_defaults_need_no_tuning(monkeypatch):
    """A cold H100 gets the sweep's fastest tiles without timing; the shipped file matches the sweep."""
    with open(os.path.join(ROOT, "benchmarks/results/attention_tiles_nvidia_h100_80gb_hbm3.json")) as f:
        sweep = json.load(f)
    best = {}
    for r in sweep["rows"]:
        if (r["mode"], r["kernel"]) not in best or r["ms"] < best[r["mode"], r["kernel"]]["ms"]:
            best[r["mode"], r["kernel"]] = r
    shipped = tiles.shipped_tiles(sweep["device"])
    for (mode, kernel), r in best.items():
        k = key(kernel=kernel, mode=mode, head_dim=128, seqlen_bucket=tiles.seqlen_bucket(sweep["shape"]["T"]))
        assert shipped[k.name()] == TileConfig(*r["tile"])
        tile, timer = choose(monkeypatch, k, sweep["device"])
        assert tile == TileConfig(*r["tile"]) and timer.timed == 0
    assert tiles.shipped_tiles("NVIDIA H200")  # same tiles, marked as not measured there
    # an unshipped class is tuned
    _, timer = choose(monkeypatch, key(head_dim=256), sweep["device"])
    assert timer.timed > 0


def test_autotune_env(monkeypatch):
    k = key()
    first, _ = choose(monkeypatch, k)
    forget_process_state(monkeypatch)
    monkeypatch.setenv("FLAME_ATTN_AUTOTUNE", "0")
    tile, timer = choose(monkeypatch, k)
    assert tile == first and timer.timed == 0                 # "0" still reads the cache, never times
    forget_process_state(monkeypatch)
    tile, timer = choose(monkeypatch, key(mode="softmax"))
    assert timer.timed == 0 and tile == tiles.candidates("fwd", "softmax", 64)[0]
    forget_process_state(monkeypatch)
    monkeypatch.setenv("FLAME_ATTN_AUTOTUNE", "force")
    tile, timer = choose(monkeypatch, k)
    assert timer.timed == len(timer.ms) and tile == timer.fastest()
    forget_process_state(monkeypatch)
    monkeypatch.setenv("FLAME_ATTN_AUTOTUNE", "1")
    assert choose(monkeypatch, k)[0] == tile                  # the forced result replaced the entry
    forget_process_state(monkeypatch)
    monkeypatch.setenv("FLAME_ATTN_AUTOTUNE", "yes")
    with pytest.raises(ConfigError, match="FLAME_ATTN_AUTOTUNE='yes'"):
        choose(monkeypatch, k)


def test_corrupt_file_ignored_with_one_warning(monkeypatch):
    path = tiles.cache_path(GPU, tiles.flame_version(), "3.6.0")
    path.parent.mkdir(parents=True)
    path.write_text('{"tiles": {"fwd/so')
    with pytest.warns(RuntimeWarning, match="unreadable") as caught:
        tile, timer = choose(monkeypatch, key())
        choose(monkeypatch, key(mode="softmax"))
    assert len([w for w in caught if "tile cache" in str(w.message)]) == 1
    assert timer.timed > 0 and tiles.load_cache(path)[key().name()] == tile  # rewritten, valid again
    path.write_text('{"tiles": {"x": [1, 2]}}')
    assert tiles.load_cache(path) == {}


def _write_keys(path, worker, n):
    for i in range(n):
        tiles.store_entry(path, f"w{worker}/k{i}", TileConfig(16 * (worker + 1), 16, 4, i % 4 + 1), float(i), {})


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.json"
    n = 15
    # spawn, not fork: a child forked from a test worker inherits whatever earlier tests compiled
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_keys, args=(path, w, n)) for w in range(3)]
    threads = [threading.Thread(target=_write_keys, args=(path, w, n)) for w in range(3, 6)]
    for x in procs + threads:
        x.start()
    for x in procs + threads:
        x.join()
    assert all(p.exitcode == 0 for p in procs)
    got = tiles.load_cache(path)
    assert got == {f"w{w}/k{i}": TileConfig(16 * (w + 1), 16, 4, i % 4 + 1) for w in range(6) for i in range(n)}


def test_tune_output_keeps_other_shapes_and_gpus():
    """Re-tuning one shape on a GPU replaces its entries only: the GPU's other shapes and other GPUs stay."""
    from flame.ops.attention.tune import merge_tuned

    data = {"format": 1, "devices": {
        "GPU A": {"source": "first", "triton": "3.5", "torch": "2.10",
                  "tiles": {"fwd/softmax/d64/x": {"tile": [64, 64, 4, 3], "ms": 2.0},
                            "fwd/softmax/d128/x": {"tile": [128, 64, 8, 3], "ms": 1.0}}},
        "GPU B": {"source": "b", "tiles": {"fwd/softmax/d64/x": {"tile": [32, 32, 4, 2], "ms": 3.0}}}}}
    merge_tuned(data, "GPU A", {"fwd/softmax/d64/x": {"tile": [128, 64, 8, 4], "ms": 1.5}}, "second", "3.6", "2.11")
    a = data["devices"]["GPU A"]
    assert a["tiles"] == {"fwd/softmax/d128/x": {"tile": [128, 64, 8, 3], "ms": 1.0},
                          "fwd/softmax/d64/x": {"tile": [128, 64, 8, 4], "ms": 1.5}}
    assert a["source"] == "first; then second" and a["triton"] == "3.6"
    assert data["devices"]["GPU B"]["tiles"] == {"fwd/softmax/d64/x": {"tile": [32, 32, 4, 2], "ms": 3.0}}
    merge_tuned(data, "GPU C", {"dq/softpick/d64/x": {"tile": [64, 32, 4, 3], "ms": 1.0}}, "third", "3.6", "2.11")
    assert data["devices"]["GPU C"]["source"] == "third"
