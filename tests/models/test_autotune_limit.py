import pytest
import triton
import triton.language as tl

from flame.errors import ConfigError
from flame.utils import autotune


def test_spread_pick_keeps_ends_and_order():
    xs = list(range(10))
    assert autotune.spread_pick(xs, 1) == [0]
    assert autotune.spread_pick(xs, 2) == [0, 9]
    assert autotune.spread_pick(xs, 4) == [0, 3, 6, 9]
    assert autotune.spread_pick(xs, 20) == xs


@triton.jit
def _copy(x, y, B: tl.constexpr):
    pass


def test_limit_autotune_caps_real_autotuner(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    tuned = triton.autotune(configs=[triton.Config({"B": b}) for b in (16, 32, 64, 128, 256)], key=[])(_copy)
    assert len(tuned.prune_configs({})) == 5
    autotune.limit_autotune(2)
    assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16, 256]
    autotune.limit_autotune(3)  # re-capping wraps the original, not the capped one
    assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16, 64, 256]


@pytest.mark.parametrize("raw", ["x", "-1"])
def test_bad_env_value_is_named(monkeypatch, raw):
    monkeypatch.setenv(autotune.ENV, raw)
    with pytest.raises(ConfigError, match=raw):
        autotune.limit_autotune_from_env()
        autotune.limit_autotune_from_env()


def _result_tree(root, hashes):
    for h in hashes:
        (root / h).mkdir(parents=True)
        (root / h / f"kern_{h}.autotune.json").write_text(f'{{"key": ["{h}"], "configs_timings": []}}')


def test_seeding_adds_the_shipped_results_once_and_keeps_the_cache_s_own(tmp_path, monkeypatch):
    cache = tmp_path / "triton_cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    shipped = tmp_path / "shipped"
    _result_tree(shipped, ["a1", "b2"])
    (cache / "b2").mkdir(parents=True)
    (cache / "b2" / "kern_b2.autotune.json").write_text("this machine's own result")
    assert autotune.seed_autotune_results(shipped) == 1
    assert (cache / "a1" / "kern_a1.autotune.json").read_text() == (shipped / "a1" / "kern_a1.autotune.json").read_text()
    assert (cache / "b2" / "kern_b2.autotune.json").read_text() == "this machine's own result"
    assert autotune.seed_autotune_results(shipped) == 0
    assert autotune.seed_autotune_results(tmp_path / "no_such_folder") == 0


def test_export_copies_every_result_under_its_hash(tmp_path):
    cache = tmp_path / "cache"
    _result_tree(cache, ["c3", "d4"])
    (cache / "c3" / "kern.cubin").write_bytes(b"\0")  # compiled kernels are not results
    assert autotune.export_autotune_results(cache, tmp_path / "out") == 2
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*.json")) == [
        "c3/kern_c3.autotune.json", "d4/kern_d4.autotune.json"]


@triton.jit
def _scale(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_seeded_result_is_used_without_timing_on_the_gpu(tmp_path, monkeypatch):
    """Exported from one cache and seeded into an empty one, a result makes a fresh autotuner of
    the same kernel pick its config without timing any."""
    import torch
    from triton.runtime.autotuner import Autotuner

    def tuned():
        return triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (64, 128, 256)], key=["n"],
                               cache_results=True)(_scale)

    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    first = tmp_path / "first"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(first))
    k = tuned()
    k[lambda meta: (triton.cdiv(4096, meta["BLOCK"]),)](x, y, 4096)
    torch.testing.assert_close(y, 2 * x)
    chosen = k.best_config.kwargs
    shipped = tmp_path / "shipped"
    assert autotune.export_autotune_results(first, shipped) == 1

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second"))
    assert autotune.seed_autotune_results(shipped) == 1
    monkeypatch.setattr(Autotuner, "_bench", lambda *a, **kw: pytest.fail("timed a config"))
    k = tuned()
    y.zero_()
    k[lambda meta: (triton.cdiv(4096, meta["BLOCK"]),)](x, y, 4096)
    torch.testing.assert_close(y, 2 * x)
    assert k.best_config.kwargs == chosen


def test_export_cli_names_a_missing_cache(tmp_path, capsys):
    assert autotune.main(["export", "--cache", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flame: error: --cache") and "nope" in err[0]


def test_an_unwritable_cache_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    shipped = tmp_path / "shipped"
    _result_tree(shipped, ["e5"])
    monkeypatch.setattr(autotune, "results_folder", lambda root=None: shipped)
    blocker = tmp_path / "file_not_dir"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "cache"))  # under a file: mkdir fails
    with caplog.at_level("WARNING"):
        autotune.prepare_triton_autotune("cuda")
    assert "not seeded" in caplog.text
