"""Helpers shared by the data tests: tiny synthetic corpora and batch bookkeeping."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from flame.data import build_dataloader_from_options, load_tokenizer, options_for_test
from flame.data.shards import ShardWriter

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = str(REPO / "flame" / "assets" / "tokenizer")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def tokenizer():
    return load_tokenizer(TOKENIZER)


def token_docs(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 8000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def write_token_folder(path: Path, docs: list[list[int]], shard_tokens: int = 1 << 20) -> str:
    w = ShardWriter(path, vocab_size=8192, shard_tokens=shard_tokens)
    w.add(docs)
    w.close()
    return str(path)


def text_docs(n: int, seed: int = 0, prefix: str = "doc") -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{prefix} {i} : " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 30)))) for i in range(n)]


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> str:
    os.makedirs(path.parent, exist_ok=True)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({column: t, "id": t.split(" : ")[0]}) + "\n")
    return str(path)


def assert_quiet(capfd, caplog) -> None:
    """Nothing printed and no log record of ``datasets`` (the caller checks flame's own error), and
    datasets' progress bars and logging as they were (on, as a first-time user has them)."""
    import datasets.utils.logging as dlog

    out, err = capfd.readouterr()
    assert out + err == "", (out, err)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]
    assert dlog.is_progress_bar_enabled() and dlog.get_logger().propagate


def build(tok, rank: int = 0, world: int = 1, **kw):
    kw.setdefault("extra", {"trace": True})
    return build_dataloader_from_options(options_for_test(**kw), tok, rank, world)


def full_doc(raw: list[int], bos: int | None, eos: int | None) -> list[int]:
    return ([bos] if bos is not None else []) + list(raw) + ([eos] if eos is not None else [])


def check_batch_content(batch: dict, docs_by_source: list[list[list[int]]], bos, eos) -> None:
    """The trace of a batch must match its input tokens exactly, in order."""
    flat = batch["input_ids"].flatten().tolist()
    pos = 0
    for s, d, _e, a, b in batch["_trace"]:
        want = full_doc(docs_by_source[s][d], bos, eos)[a:b]
        assert flat[pos:pos + b - a] == want, (s, d, a, b)
        pos += b - a
    assert pos == len(flat)


def coverage(traces) -> dict[tuple[int, int, int], list[tuple[int, int]]]:
    """(source, doc, epoch) -> sorted emitted token ranges."""
    cov = defaultdict(list)
    for trace in traces:
        for s, d, e, a, b in trace:
            cov[(s, d, e)].append((a, b))
    return {k: sorted(v) for k, v in cov.items()}


def assert_no_overlap(cov) -> None:
    for key, ranges in cov.items():
        for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
            assert b0 <= a1, f"document {key} emitted twice: {ranges}"


def complete_docs(cov, lengths: dict[tuple[int, int], int]) -> set:
    """(source, doc, epoch) whose emitted ranges together cover the whole document."""
    done = set()
    for (s, d, e), ranges in cov.items():
        pos = 0
        for a, b in ranges:
            if a > pos:
                break
            pos = max(pos, b)
        if pos == lengths[(s, d)]:
            done.add((s, d, e))
    return done


def take(loader, n: int) -> list[dict]:
    it = iter(loader)
    out = []
    for _ in range(n):
        b = next(it)
        b["_consumer"] = loader.last_consumer
        out.append(b)
    return out


def same_batches(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        keys = [k for k in x if not k.startswith("_")]
        if sorted(keys) != sorted(k for k in y if not k.startswith("_")):
            return False
        if not all(torch.equal(x[k], y[k]) for k in keys):
            return False
    return True
