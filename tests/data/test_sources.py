"""Sources: formats, streaming vs map-style, pre-tokenized data, mixing frequencies."""

import json

import datasets
import numpy as np
import pandas as pd
import pytest
from flame_data_testlib import (
    assert_no_overlap,
    assert_quiet,
    build,
    check_batch_content,
    complete_docs,
    coverage,
    same_batches,
    take,
    text_docs,
    token_docs,
    write_jsonl,
    write_token_folder,
)

from flame.data import state as gstate
from flame.data.loader import STATE_KEY
from flame.errors import ConfigError
from flame.utils.preprocess import main as preprocess_main


def test_formats_and_column_detection(tmp_path, tok):
    texts = text_docs(12)
    pd.DataFrame({"content": texts}).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(t)
    raw = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    for ds, extra in [(str(tmp_path / "d.parquet"), {}),
                      ("parquet", {"data_files": str(tmp_path / "*.parquet")}),
                      (write_jsonl(tmp_path / "j" / "x.jsonl", texts, column="body"), {"text_column": "body"})]:
        b = take(build(tok, dataset=ds, seq_len=16, shuffle=False, **extra), 1)[0]
        check_batch_content(b, [raw], tok.bos_token_id, tok.eos_token_id)
    b = take(build(tok, dataset=str(tmp_path / "txt" / "*.txt"), seq_len=8, shuffle=False), 1)[0]
    assert b["input_ids"].shape == (2, 8)


def test_input_ids_column_is_not_retokenized(tmp_path, tok):
    docs = token_docs(10)
    with open(tmp_path / "ids.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"input_ids": d}) + "\n")
    b = take(build(tok, dataset=str(tmp_path / "ids.jsonl"), seq_len=16, shuffle=False), 1)[0]
    check_batch_content(b, [docs], tok.bos_token_id, tok.eos_token_id)


def test_preprocessed_folder_gives_the_same_batches_as_text(tmp_path, tok, monkeypatch):
    import datasets.arrow_dataset

    def no_pool(*a, **k):
        raise AssertionError("--num-proc 1 started a process pool")

    # a pool forked from a process with threads (a test worker, a launcher) can die on start
    monkeypatch.setattr(datasets.arrow_dataset.mp, "Pool", no_pool)
    texts = text_docs(30)
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "tokens"
    assert preprocess_main(["--dataset", path, "--tokenizer", tok.name_or_path, "--output", str(out),
                            "--shard-tokens", "100"]) == 0
    assert len(json.loads((out / "flame_tokens.json").read_text())["shards"]) > 1
    kw = dict(batch_size=2, seq_len=24, seed=4, varlen=True, context_len=12)
    assert same_batches(take(build(tok, dataset=path, **kw), 6), take(build(tok, dataset=str(out), **kw), 6))


def test_streaming_matches_map_style(tmp_path, tok):
    texts = text_docs(40)
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    raw = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    kw = dict(dataset=path, batch_size=2, seq_len=16, seed=2)
    # Unshuffled: the very same token stream.
    assert same_batches(take(build(tok, shuffle=False, **kw), 8), take(build(tok, shuffle=False, streaming=True, **kw), 8))
    # Shuffled (permutation vs block shuffle): the same documents in each epoch, in another order.
    for streaming in (False, True):
        batches = take(build(tok, streaming=streaming, shuffle_buffer_size=8, **kw), 60)
        for b in batches:
            check_batch_content(b, [raw], tok.bos_token_id, tok.eos_token_id)
        cov = coverage(b["_trace"] for b in batches)
        assert_no_overlap(cov)
        lengths = {(0, d): len(r) + 2 for d, r in enumerate(raw)}
        assert {k for k in complete_docs(cov, lengths) if k[2] == 0} == {(0, d, 0) for d in range(40)}


def test_streaming_resume_exact_and_elastic_without_skips(tmp_path, tok):
    texts = text_docs(40, seed=3)
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    kw = dict(dataset=path, batch_size=2, seq_len=16, seed=2, streaming=True, shuffle_buffer_size=8)
    first = build(tok, num_workers=2, **kw)
    it = iter(first)
    before = [next(it) for _ in range(5)]
    saved = json.loads(first.state_dict()[STATE_KEY])
    expected = [next(it) for _ in range(6)]
    again = build(tok, num_workers=2, **kw)
    again.load_state_dict({STATE_KEY: json.dumps(saved)})
    assert same_batches(take(again, 6), expected)
    # 2 consumers -> 1: restart at the slowest position; nothing skipped, repeats only within the lag.
    one = build(tok, **kw)
    one.load_state_dict({STATE_KEY: json.dumps(saved)})
    after = take(one, 80)
    cov = coverage(b["_trace"] for b in before + after)
    raw = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    lengths = {(0, d): len(r) + 2 for d, r in enumerate(raw)}
    assert {k for k in complete_docs(cov, lengths) if k[2] == 0} == {(0, d, 0) for d in range(40)}


def _doc_sources(batches):
    return np.asarray([t[0] for b in batches for t in b["_trace"] if t[3] == 0])


def test_sampling_frequencies_match_data_probs(tmp_path, tok):
    paths = [write_token_folder(tmp_path / f"s{i}", token_docs(50, seed=i, lo=1, hi=4)) for i in range(3)]
    probs = [0.6, 0.3, 0.1]
    batches = take(build(tok, 0, 2, dataset=",".join(paths), data_probs=[6, 3, 1], batch_size=4, seq_len=64,
                         num_workers=2, boundary_policy="none"), 40)
    src = _doc_sources(batches)
    n = len(src)
    counts = np.bincount(src, minlength=3)
    assert n > 3000
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))
    assert chi2 < 13.8, (counts / n, chi2)  # p = 0.001 for 2 degrees of freedom


def test_mix_by_tokens_balances_token_shares(tmp_path, tok):
    short = write_token_folder(tmp_path / "short", token_docs(50, seed=1, lo=2, hi=5))
    long = write_token_folder(tmp_path / "long", token_docs(50, seed=2, lo=30, hi=60))
    loader = build(tok, dataset=f"{short},{long}", data_probs=[0.5, 0.5], mix_by="tokens", batch_size=4,
                   seq_len=64)
    take(loader, 30)
    counts = loader.source_token_counts()
    share = counts[short] / (counts[short] + counts[long])
    assert abs(share - 0.5) < 0.02, counts
    by_docs = build(tok, dataset=f"{short},{long}", data_probs=[0.5, 0.5], batch_size=4, seq_len=64)
    take(by_docs, 30)
    c = by_docs.source_token_counts()
    assert c[short] / (c[short] + c[long]) < 0.2  # per-document sampling favours the long documents' tokens


def test_small_source_repeats_instead_of_being_dropped(tmp_path, tok):
    small = write_token_folder(tmp_path / "small", token_docs(3, seed=1))
    big = write_token_folder(tmp_path / "big", token_docs(300, seed=2))
    loader = build(tok, dataset=f"{small},{big}", data_probs=[0.5, 0.5], batch_size=4, seq_len=32)
    batches = take(loader, 30)
    epochs = {t[2] for b in batches for t in b["_trace"] if t[0] == 0}
    assert len(epochs) > 3
    g = json.loads(loader.state_dict()[STATE_KEY])
    assert gstate.token_totals(g)[0] > 0


def test_a_text_column_for_a_preprocessed_folder_is_named(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", text_docs(10))
    out = tmp_path / "tokens"
    assert preprocess_main(["--dataset", path, "--tokenizer", tok.name_or_path, "--output", str(out)]) == 0
    with pytest.raises(ConfigError, match="training.text_column: 'body' is not a column of .*pre-tokenized folder"):
        take(build(tok, dataset=str(out), batch_size=2, seq_len=16, text_column="body"), 1)
    take(build(tok, dataset=str(out), batch_size=2, seq_len=16, text_column="input_ids"), 1)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_line_that_is_not_json_is_one_error_line(tmp_path, tok, capfd, caplog, streaming):
    datasets.enable_progress_bar()
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"broken\.jsonl' could not be loaded: .*JSON parse error"):
        build(tok, dataset=str(path), streaming=streaming)  # streaming: it was a traceback
    assert_quiet(capfd, caplog)  # datasets printed its bars and logged the parse error (ERROR) itself


def test_a_large_local_load_is_announced(tmp_path, tok, caplog, monkeypatch):
    """datasets' progress bars are off while a source loads: a large map-style load of local files
    says what it does first (files from ANNOUNCE_BYTES on: lowered here to this tiny file's size)."""
    import logging

    import flame.data.sources as sources

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine words"}\n')
    with caplog.at_level(logging.INFO):
        build(tok, dataset=str(path), streaming=False)
    assert "converting" not in caplog.text
    monkeypatch.setattr(sources, "ANNOUNCE_BYTES", path.stat().st_size)
    with caplog.at_level(logging.INFO):
        build(tok, dataset=str(path), streaming=False)
    assert "docs.jsonl: converting 0.0 GiB of files into datasets' cache" in caplog.text


@pytest.mark.parametrize("content", ['{"text": "fine"}\nnot json\n', '{"body": "no text column"}\n'])
def test_preprocess_of_a_bad_file_prints_one_error_line(tmp_path, tok, capfd, content):
    datasets.enable_progress_bar()
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert preprocess_main(["--dataset", str(path), "--tokenizer", tok.name_or_path,
                            "--output", str(tmp_path / "out")]) == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(("flame: error: --dataset", "flame: error: --text-column")), err
