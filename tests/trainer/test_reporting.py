"""What a run reports: validation with research probes, per-source validation names, the held-out
probe batch, option checks, and `python -m flame.plot --out`."""

import os

import pytest
import torch

from flame import plot
from flame.config.manager import FlameConfigManager
from flame.data.options import options_from_job_config
from flame.data.validation import SourceLossMeter
from flame.errors import ConfigError
from tests.trainer.helpers import CORPUS, TOML, TINY_LLAMA, metrics, run_job


def test_probes_run_next_to_validation(tmp_path):
    """--probes.interval with --validation.enable reads the first batch of the validation loader
    (it crashed: `val_loader or ...` asked the IterableDataset loader for its len())."""
    dump = str(tmp_path / "run")
    run_job(1, dump, "--training.steps", "2", "--validation.enable", "--validation.freq", "2",
            "--validation.steps", "1", "--probes.interval", "2")
    records = metrics(dump)
    assert any("validation/loss" in r and r["step"] == 2 for r in records)
    assert any("probes/max_abs_hidden" in r and r["step"] == 2 for r in records)


def _cfg(tmp_path, *args):
    return FlameConfigManager().parse_args(["--job.config_file", TOML, "--model.config", TINY_LLAMA,
                                            "--job.dump_folder", str(tmp_path / "run"), *args])


def test_probes_batch_is_held_out_of_training(tmp_path):
    """A training source without a validation split: the probes' batch comes from its held-out
    documents, which training then skips, also when validation itself is off."""
    source = os.path.join(CORPUS, "train.jsonl.gz")
    cfg = _cfg(tmp_path, "--training.dataset", source, "--probes.interval", "5")
    assert options_from_job_config(cfg, "train").holdout_fraction == pytest.approx(0.005)
    assert options_from_job_config(cfg, "validation").holdout_fraction == pytest.approx(0.005)
    plain = _cfg(tmp_path, "--training.dataset", source)
    assert options_from_job_config(plain, "train").holdout_fraction == 0.0


@pytest.mark.parametrize("args, says", [
    (["--validation.enable", "--validation.seq_len", "1"], "validation.seq_len 1: must be >= 2"),
    (["--probes.interval", "-3"], "probes.interval -3: must be >= 0"),
    (["--probes.sink_threshold", "2"], "probes.sink_threshold 2.0: must be in"),
])
def test_reporting_options_name_themselves(tmp_path, args, says):
    with pytest.raises(ConfigError, match=says):
        _cfg(tmp_path, *args)


def test_validation_sources_with_one_file_name_keep_their_own_loss():
    meter = SourceLossMeter(["/data/a/val.jsonl", "/data/b/val.jsonl"])
    meter.update(torch.tensor([1.0, 1.0, 5.0, 5.0]), torch.tensor([1, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
    out = meter.compute(reduce=False)
    assert out["validation/a/val.jsonl/loss"] == 1.0 and out["validation/b/val.jsonl/loss"] == 5.0
    assert out["validation/loss"] == 3.0
    assert list(SourceLossMeter(["x/c", "x/c", "sample_corpus"]).keys) == ["x/c", "x/c#2", "sample_corpus"]


def test_plot_out_mistakes_are_one_line(tmp_path, capsys):
    run = tmp_path / "a"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    for out, says in ((tmp_path / "missing" / "runs.html", "does not exist"),
                      (tmp_path / "runs", "no file type")):  # matplotlib would write runs.png
        assert plot.main([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("flame: error: --out") and says in err[0]
    assert not (tmp_path / "runs.png").exists()
    pytest.importorskip("matplotlib")
    assert plot.main([str(run), "--out", str(tmp_path / "runs.txt")]) == 2
    assert "cannot write .txt" in capsys.readouterr().err
