"""Long documents (tokenized in pieces, memory bounded) and bad rows (skip / replace / error)."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flame_data_testlib import REPO, WORDS, build, check_batch_content, same_batches, take

import flame.data.documents as documents
from flame.data.documents import piece_bounds
from flame.errors import ConfigError


def long_text(n_chars: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS + ["\n", "\n\n", "  ", "1234", "é", ",", "日本"], size=n_chars // 4 + 8)
    return " ".join(words)[:n_chars]


def whole(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_pieces_are_deterministic_and_tokenize_like_the_whole_text(tok):
    text = long_text(40_000, seed=1)
    bounds = list(piece_bounds(text, 1000))
    assert bounds == list(piece_bounds(text, 1000)) and len(bounds) > 40
    assert all(0 < b - a <= 1000 for a, b in bounds)
    assert "".join(text[a:b] for a, b in bounds) == text
    pieces = [i for a, b in bounds for i in whole(tok, text[a:b])]
    assert pieces == whole(tok, text)
    # No space between non-spaces in a stretch: cut after the last newline, else at the size exactly.
    run = "x" * 700 + "\n" + "y" * 2000
    assert [b - a for a, b in piece_bounds(run, 1000)] == [701, 1000, 1000]


def _write_rows(path, rows: list[bytes]) -> str:
    path.write_bytes(b"\n".join(rows) + b"\n")
    return str(path)


@pytest.mark.parametrize("streaming", [False, True])
def test_long_documents_stream_in_pieces_and_resume_exactly(tmp_path, tok, monkeypatch, streaming):
    monkeypatch.setattr(documents, "PIECE_CHARS", 300)
    texts = [long_text(n, seed=i) for i, n in enumerate([4000, 50, 2500, 10, 3000])]
    path = _write_rows(tmp_path / "long.jsonl", [json.dumps({"text": t}).encode() for t in texts])
    raw = [whole(tok, t) for t in texts]
    kw = dict(dataset=path, batch_size=2, seq_len=40, seed=3, streaming=streaming, shuffle_buffer_size=4)
    reference = take(build(tok, **kw), 40)
    for b in reference:
        check_batch_content(b, [raw], tok.bos_token_id, tok.eos_token_id)
    for n in (3, 17):  # inside the first long document and the next one
        first = build(tok, **kw)
        take(first, n)
        resumed = build(tok, **kw)
        resumed.load_state_dict(first.state_dict())
        assert same_batches(take(resumed, 4), reference[n:n + 4]), n


BAD = b'{"text": "broken \xff\xfe row", "id": 1}'


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_rows_are_skipped_counted_logged_once_and_resume_exactly(tmp_path, tok, caplog, streaming):
    good = [f"row {i} " + " ".join(WORDS[i % 7:i % 7 + 5]) for i in range(12)]
    rows = [json.dumps({"text": t, "id": 0}).encode() for t in good]
    rows[3:3] = [BAD]
    rows[8:8] = [BAD]  # rows 4 and 9 of the file (counted from 1)
    path = _write_rows(tmp_path / "bad.jsonl", rows)
    raw = [whole(tok, t) for t in good]
    kw = dict(dataset=path, batch_size=2, seq_len=16, seed=1, shuffle=False, streaming=streaming)
    with caplog.at_level(logging.WARNING):
        loader = build(tok, **kw)
        batches = take(loader, 8)  # more than one epoch: each bad row is met twice
    flat = [t for b in batches for t in b["input_ids"].flatten().tolist()]
    docs = [d for _s, d, _e, a, _b in (t for b in batches for t in b["_trace"]) if a == 0]
    assert 3 not in docs and 8 not in docs  # skipped rows are positions 3 and 8 of the source
    for b in batches:  # every emitted token is a token of a good row, in order
        good_by_index = {i if i < 3 else (i + 1 if i < 7 else i + 2): r for i, r in enumerate(raw)}
        check_batch_content(b, [[good_by_index.get(i, []) for i in range(14)]], tok.bos_token_id, tok.eos_token_id)
    assert len(flat) == 8 * 2 * 16
    c = loader.global_state()["consumers"]["0"]
    passed = c["taken"][0] if not streaming else c["stream"][0]["epoch"] * 14 + c["stream"][0]["pos"]
    assert passed > 14  # into the second epoch
    assert loader.bad_document_counts() == {path: sum(p % 14 in (3, 8) for p in range(passed))}
    lines = [r.getMessage() for r in caplog.records if "not valid UTF-8" in r.getMessage()]
    assert len(lines) == 1 and f"{path}, row 4" in lines[0]
    for n in range(1, 7):
        first = build(tok, **kw)
        it = iter(first)
        for _ in range(n):
            next(it)
        resumed = build(tok, **kw)
        resumed.load_state_dict(first.state_dict())
        assert same_batches(take(resumed, 2), batches[n:n + 2]), n
        next(it), next(it)
        assert resumed.bad_document_counts() == first.bad_document_counts(), n


def test_replace_and_error_policies(tmp_path, tok):
    rows = [json.dumps({"text": f"good {i}"}).encode() for i in range(4)]
    rows.insert(2, BAD)
    path = _write_rows(tmp_path / "b.jsonl", rows)
    b = take(build(tok, dataset=path, shuffle=False, seq_len=64, bad_document_policy="replace"), 1)[0]
    replaced = whole(tok, BAD.decode("utf-8", errors="replace")[10:-11])
    flat = b["input_ids"].flatten().tolist()
    assert any(flat[i:i + len(replaced)] == replaced for i in range(len(flat)))
    with pytest.raises(ConfigError, match=r"bad_document_policy: 'error' stops at .*b\.jsonl, row 3: byte 7"):
        take(build(tok, dataset=path, shuffle=False, seq_len=64, bad_document_policy="error"), 1)
    # .txt files are decoded while loading: a bad file (one document) is found before training.
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("fine text here")
    (tmp_path / "t" / "b.txt").write_bytes(b"bad \xff text")
    b = take(build(tok, dataset=str(tmp_path / "t" / "*.txt"), shuffle=False, seq_len=8, batch_size=1), 1)[0]
    assert b["input_ids"][0].tolist()[1:5] == whole(tok, "fine text here")[:4]
    with pytest.raises(ConfigError, match=r"b\.txt, row 1"):
        build(tok, dataset=str(tmp_path / "t" / "*.txt"), bad_document_policy="error")
    with pytest.raises(ConfigError, match="bad_document_policy: 'drop'"):
        build(tok, dataset=path, bad_document_policy="drop")


RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import datasets
    import flame.data.documents  # this checkout's flame, not an installed one
    from flame_data_testlib import WORDS, build, take, tokenizer
    path = sys.argv[1]
    words = " ".join(WORDS) + "\\n"
    with open(path, "w") as f:  # a 3-document source, one document of 2 MB
        f.write(json.dumps({"text": words * (2_000_000 // len(words))}) + "\\n")
        f.write(json.dumps({"text": "a small one"}) + "\\n" + json.dumps({"text": "another"}) + "\\n")
    from flame.components.metrics import peak_rss_bytes  # the process's own peak, not its parent's

    def high_water_kib():
        return peak_rss_bytes() // 1024

    tok = tokenizer()
    base = high_water_kib()
    for streaming in (False, True):
        take(build(tok, dataset=path, batch_size=8, seq_len=256, seed=1, streaming=streaming, extra={}), 12)
    print(json.dumps([base, high_water_kib()]))
""")


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_bad_txt_files_join_the_token_count_line(tmp_path, tok, caplog, policy):
    # .txt files are checked when the source is opened, and used to be left out of the counts
    (tmp_path / "a.txt").write_text("fine text here")
    (tmp_path / "b.txt").write_bytes(b"bad \xff text")
    pattern = str(tmp_path / "*.txt")
    kw = dict(dataset=pattern, shuffle=False, seq_len=8, batch_size=1, bad_document_policy=policy)
    loader = build(tok, **kw)
    take(loader, 1)
    assert loader.bad_document_counts() == {pattern: 1}
    with caplog.at_level(logging.INFO):
        state = loader.state_dict()
    assert any(f"bad rows ({policy}): {pattern}=1" in r.getMessage() for r in caplog.records)
    resumed = build(tok, **kw)
    resumed.load_state_dict(state)
    assert resumed.bad_document_counts() == {pattern: 1}  # found again on opening, not also carried over


def test_long_document_in_a_tiny_source_keeps_loader_memory_bounded(tmp_path):
    # peak resident memory of a fresh process (KiB): imports take ~0.5 GB; the loader may add little on top. Before
    # the fix a 1 MB document in a 3-document source took 1.4 GB (32 copies tokenized per fetch).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "data")])}
    r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "big.jsonl")],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    base, peak = json.loads(r.stdout.strip().splitlines()[-1])
    assert peak < 1024 * 1024 and peak - base < 200 * 1024, (base, peak)
