"""`python -m flame.plot`: a picture of runs from their metrics.jsonl (synthetic records)."""

import json
import re
import sys

import pytest

from flame import plot


def write_run(folder, losses, val=None, relaunch_step=None):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3 * step, "tokens_per_second": 100.0 + step}) + "\n")
        for step, value in (val or {}).items():
            f.write(json.dumps({"step": step, "validation/loss": value, "validation/sample/loss": value}) + "\n")
        if relaunch_step is not None:  # a relaunch logs a step again: the latest record wins
            f.write(json.dumps({"step": relaunch_step, "loss": 0.5, "lr": 0.0, "tokens_per_second": 1.0}) + "\n")
        f.write('{"step": 9, "lo')  # killed mid-write
    return str(folder)


def test_read_run_keeps_latest_record_per_step(tmp_path):
    run = read = plot.read_run(write_run(tmp_path / "a", [4.0, 3.0, 2.0], val={2: 3.5}, relaunch_step=2))
    assert read["loss"] == [(1, 4.0), (2, 0.5), (3, 2.0)]
    assert run["validation/loss"] == [(2, 3.5)] and run["memory_peak_gib"] == []
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(plot.ConfigError, match=r"metrics.jsonl:2: not a JSON record"):
        plot.read_run(str(bad))


def test_html_has_one_chart_per_metric_and_a_line_per_run(tmp_path):
    a = write_run(tmp_path / "a", [4.0, 3.0, 2.0, 1.0], val={2: 3.5, 4: 2.5})
    b = write_run(tmp_path / "b", [5.0, 2.0, 1.5, 1.2])
    out = plot.plot([a, b], str(tmp_path / "runs.html"))
    page = open(out).read()
    assert page.count("<svg") == len(plot.PANELS) and "not recorded" in page  # no GPU memory on CPU
    lines = re.findall(r'<polyline points="([^"]+)"[^>]*><title>(\w+)</title>', page)
    # loss, validation loss (only a validated), lr, tokens/s
    assert [label for _, label in lines] == ["a", "b", "a", "a", "b", "a", "b"]
    # the loss chart: run b's first point (5.0, the maximum) sits on the top edge, a's last on the
    # bottom edge (1.0, the minimum); steps 1..4 span the plot's width
    first_b = [tuple(map(float, p.split(","))) for p in lines[1][0].split()]
    last_a = [tuple(map(float, p.split(","))) for p in lines[0][0].split()][-1]
    assert first_b[0] == (70.0, 24.0) and last_a == (630.0, 190.0) and len(first_b) == 4


def test_validation_chart_only_has_runs_that_validated(tmp_path):
    a = write_run(tmp_path / "a", [4.0, 3.0], val={1: 3.5, 2: 2.5})
    b = write_run(tmp_path / "b", [5.0, 2.0])
    page = open(plot.plot([a, b], str(tmp_path / "runs.html"))).read()
    svgs = page.split("<svg")[1:]
    assert svgs[1].count("<polyline") == 1 and "<title>a</title>" in svgs[1]


def test_png_or_html_without_matplotlib(tmp_path, monkeypatch, capsys):
    a = write_run(tmp_path / "a", [4.0, 3.0, 2.0])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the `plot` extra were not installed
    assert plot.main([a, "--out", str(tmp_path / "runs.png")]) == 0
    assert (tmp_path / "runs.html").exists() and not (tmp_path / "runs.png").exists()
    assert 'pip install -e ".[plot]"' in capsys.readouterr().out
    assert plot.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flame: error:") and "missing" in err[0]


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", [4.0, 3.0, 2.0], val={3: 2.5})
    out = plot.plot([a], str(tmp_path / "runs.png"))
    assert out.endswith(".png") and open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
