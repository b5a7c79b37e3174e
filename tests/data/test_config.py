"""The trainer-facing API (job config in, loader out), validation loaders, and bad input."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from flame_data_testlib import REPO, TOKENIZER, text_docs, write_jsonl

from flame.data import SourceLossMeter, build_dataloader, build_tokenizer, options_for_test
from flame.errors import ConfigError


def job(dataset, **training):
    t = dict(dataset=dataset, dataset_name=None, dataset_split=None, data_dir=None, data_files=None,
             data_probs=None, text_column=None, streaming=False, varlen=False, context_len=2048, num_workers=0,
             prefetch_factor=None, pin_memory=False, persistent_workers=False, seed=None, mix_by="documents",
             boundary_policy="auto", mask_cross_document_labels=False, shuffle_buffer_size=100,
             local_batch_size=2, batch_size=2, seq_len=16)
    t.update(training)
    return SimpleNamespace(
        training=SimpleNamespace(**t),
        model=SimpleNamespace(tokenizer_path=TOKENIZER),
        validation=SimpleNamespace(enable=True, dataset=None, dataset_path=None, local_batch_size=3, seq_len=8,
                                   freq=10, steps=2, holdout_fraction=0.005),
    )


def test_job_config_api_and_bundled_default(tok):
    cfg = job(str(REPO / "flame" / "assets" / "sample_corpus"), varlen=True, context_len=8)
    tokenizer = build_tokenizer(cfg)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    loader = build_dataloader(cfg, tokenizer, 0, 1)
    b = next(iter(loader))
    assert set(b) == {"input_ids", "labels", "cu_seqlens", "position_ids"}
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (2, 16)
    assert b["cu_seqlens"][0] == 0 and b["cu_seqlens"][-1] == 32
    sd = loader.state_dict()
    assert isinstance(sd, dict) and len(sd) == 1


def test_validation_loader_is_per_source_and_repeatable(tmp_path, tok):
    a = tmp_path / "a"
    write_jsonl(a / "train.jsonl", text_docs(20, prefix="a"))
    write_jsonl(a / "validation.jsonl", text_docs(6, seed=5, prefix="va"))
    b = write_jsonl(tmp_path / "b_val.jsonl", text_docs(6, seed=6, prefix="vb"))
    cfg = job(str(a))
    cfg.validation.dataset = f"{a},{b}"
    loader = build_dataloader(cfg, tok, 0, 1, split="validation")
    first = [next(iter(loader)) for _ in range(2)]
    assert torch.equal(first[0]["input_ids"], first[1]["input_ids"])  # each evaluation starts over
    batch = first[0]
    assert batch["input_ids"].shape == (3, 8)
    assert set(batch["_source_ids"].unique().tolist()) <= {0, 1}
    meter = SourceLossMeter(loader.source_names)
    it = iter(loader)
    for _ in range(4):
        batch = next(it)
        meter.update(torch.ones_like(batch["labels"], dtype=torch.float) * 2.0, batch["labels"], batch["_source_ids"])
    out = meter.compute()
    assert out["validation/loss"] == pytest.approx(2.0)
    assert out["validation/a/ppl"] == pytest.approx(torch.e ** 2)
    # The default validation set is the held-out split of the training sources.
    cfg.validation.dataset = None
    assert next(iter(build_dataloader(cfg, tok, 0, 1, split="validation")))["input_ids"].shape == (3, 8)


def test_without_a_validation_split_validation_reads_held_out_documents_only(tmp_path, tok):
    from flame_data_testlib import coverage, take

    from flame.data.holdout import held_out_rows

    texts = text_docs(300, seed=2)
    path = write_jsonl(tmp_path / "one.jsonl", texts)
    cfg = job(path, varlen=True, context_len=16, seed=3, local_batch_size=8, batch_size=8, seq_len=64)
    cfg.validation.local_batch_size = cfg.validation.seq_len = None  # default: the training ones
    cfg.validation.holdout_fraction = 0.02
    held = set(held_out_rows(300, 0.02).tolist())
    assert 0 in held and 2 <= len(held) <= 20
    val = build_dataloader(cfg, tok, 0, 1, split="validation")
    batches = take(val, 2)
    assert batches[0]["input_ids"].shape == (8, 64) and "cu_seqlens" in batches[0]
    seen = {texts_row for b in batches for texts_row in _rows_of(b, tok, texts)}
    assert seen and seen <= held
    # Training (any number of ranks) never reads a held-out document; it reads the others.
    for world in (1, 2):
        trained = set()
        for r in range(world):
            loader = build_dataloader(cfg, tok, r, world)
            loader.packed.opts.extra["trace"] = True
            trained |= {d for (_s, d, _e) in coverage(b["_trace"] for b in take(loader, 40 // world))}
        assert not trained & held and trained | held == set(range(300))  # more than an epoch
    cfg.validation.holdout_fraction = 0.0
    with pytest.raises(ConfigError, match="holdout_fraction: 0 and training source"):
        build_dataloader(cfg, tok, 0, 1, split="validation")
    assert build_dataloader(cfg, tok, 0, 1).packed.sources[0].excluded is None  # nothing held out then


def _rows_of(batch, tok, texts):
    """Rows whose tokens occur in the batch (validation batches carry no trace)."""
    flat = batch["input_ids"].flatten().tolist()
    out = set()
    for i, t in enumerate(texts):
        ids = tok(t, add_special_tokens=False)["input_ids"][:6]
        if any(flat[j:j + len(ids)] == ids for j in range(len(flat) - len(ids) + 1)):
            out.add(i)
    return out


@pytest.mark.parametrize("kw,needle", [
    (dict(dataset="x.jsonl,y.jsonl,z.jsonl", dataset_split="train,test"), "dataset_split"),
    (dict(dataset="a,b", data_probs=[1.0, -1.0]), "-1.0"),
    (dict(dataset="a,b", data_probs=[1.0]), "data_probs"),
    (dict(dataset="a", seq_len=1), "seq_len: 1"),
    (dict(dataset="a", varlen=True, context_len=64, seq_len=32), "context_len: 64"),
    (dict(dataset="a", mix_by="bytes"), "bytes"),
    (dict(dataset=" "), "dataset"),
    # used to be ignored without a word (the chat template adds the special tokens)
    (dict(dataset="a", sft=True, boundary_policy="bos"), "training.boundary_policy: 'bos' with training.sft"),
])
def test_bad_options_name_the_value(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        options_for_test(**kw)


def test_one_entry_of_a_per_source_option_applies_to_every_source():
    from flame.data.options import parse_sources

    specs = parse_sources("a,b,c", dataset_name="cfg", dataset_split="train", data_dir="d", data_files="*.jsonl")
    assert [(s.name, s.split, s.data_dir, s.data_files) for s in specs] == [("cfg", "train", "d", "*.jsonl")] * 3
    specs = parse_sources("a,b", dataset_split="train,", data_dir=",x")
    assert [(s.split, s.data_dir) for s in specs] == [("train", None), (None, "x")]
    opts = options_for_test(dataset="a,b", dataset_split="train", data_probs=[0.6, 0.4])
    assert opts.probs == pytest.approx((0.6, 0.4))


def test_bad_sources_name_the_value(tmp_path, tok):
    from flame_data_testlib import build

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nocol = write_jsonl(tmp_path / "n.jsonl", ["x"], column="body")
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text('{"text": "a document"}\nthis line is not JSON\n')
    cases = [
        (dict(dataset="./does/not/exist"), "does/not/exist"),
        # relative paths that cannot be hub ids: said missing, not looked up on the hub
        (dict(dataset="data/sft/nope.jsonl"), "'data/sft/nope.jsonl' does not exist"),
        (dict(dataset="nope.parquet"), "'nope.parquet' does not exist"),
        (dict(dataset=str(tmp_path / "*.parquet")), "matches no file"),
        (dict(dataset=nocol), "text_column"),
        (dict(dataset=nocol, text_column="nope"), "'nope'"),
        (dict(dataset="flame-nonexistent-org/nonexistent-dataset"), "nonexistent-dataset"),
        (dict(dataset=str(not_json)), "not_json.jsonl' could not be loaded: .*JSON parse error"),
    ]
    for kw, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            build(tok, **kw)
    with pytest.raises(ConfigError, match="model.tokenizer_path: .*nope': no such folder"):
        build_tokenizer(SimpleNamespace(model=SimpleNamespace(tokenizer_path=str(tmp_path / "nope"))))
    with pytest.raises(Exception, match="empty"):
        build(tok, dataset=str(empty))


def test_home_relative_dataset_path_loads(tmp_path, tok, monkeypatch):
    """A dataset path starting with "~" (e.g. from a TOML, where no shell expands it) is the same
    path for train.sh's check before the launch and for the loader."""
    from flame.data.options import missing_local_source, parse_sources
    from flame_data_testlib import build

    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "corpus.jsonl", text_docs(20))
    assert missing_local_source("~/corpus.jsonl") is None
    assert parse_sources("~/corpus.jsonl")[0].path == str(tmp_path / "corpus.jsonl")
    assert next(iter(build(tok, dataset="~/corpus.jsonl"))) is not None
    assert missing_local_source("~/nope.jsonl") == "~/nope.jsonl"
    with pytest.raises(ConfigError, match="nope.jsonl' does not exist"):
        build(tok, dataset="~/nope.jsonl")


def test_preprocess_cli_bad_input_exits_nonzero(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flame.utils.preprocess", "--dataset", str(tmp_path / "missing.jsonl"),
                        "--tokenizer", TOKENIZER, "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("flame: error: --dataset:")
    assert "missing.jsonl" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--num-proc", "--batch-size", "--shard-tokens"])
def test_preprocess_counts_must_be_positive(tmp_path, flag, capsys):
    from flame.utils.preprocess import main

    with pytest.raises(SystemExit) as stop:
        main(["--dataset", "x", "--tokenizer", "y", "--output", str(tmp_path / "o"), flag, "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == f"flame: error: {flag} 0: must be >= 1"


def test_preprocess_output_that_is_a_file_is_one_line(tmp_path, capsys):
    from flame.utils.preprocess import main

    (tmp_path / "taken").write_text("x")
    assert main(["--dataset", "x", "--tokenizer", "y", "--output", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err.strip() == f"flame: error: --output: {str(tmp_path / 'taken')!r} is a file, not a folder"
