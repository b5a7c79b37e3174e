"""Resume: exact batches on the same geometry; no document repeated or skipped on another one."""

import json

import pytest
import torch.distributed.checkpoint as dcp
from flame_data_testlib import (
    assert_no_overlap,
    build,
    check_batch_content,
    complete_docs,
    coverage,
    same_batches,
    take,
    text_docs,
    token_docs,
    tokenizer,
    write_jsonl,
    write_token_folder,
)

from flame.data import state as gstate
from flame.data.loader import STATE_KEY
from flame.errors import ConfigError


def global_state(loaders):
    return gstate.merge([json.loads(L.state_dict()[STATE_KEY]) for L in loaders])


def test_exact_resume_same_geometry_with_workers_and_mixing(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", text_docs(30, seed=1, prefix="a"))
    b = write_token_folder(tmp_path / "b", token_docs(25, seed=2))
    kw = dict(dataset=f"{a},{b}", data_probs=[0.7, 0.3], batch_size=2, seq_len=24, num_workers=2, varlen=True,
              context_len=8, seed=3, mask_cross_document_labels=True)
    for world in (1, 2):
        first = [build(tok, r, world, **kw) for r in range(world)]
        its = [iter(L) for L in first]
        for _ in range(7):  # odd: the next batch comes from the second worker
            for it in its:
                next(it)
        saved = global_state(first)
        reference = [[next(it) for _ in range(6)] for it in its]
        for r in range(world):
            resumed = build(tok, r, world, **kw)
            resumed.load_state_dict({STATE_KEY: json.dumps(saved)})
            assert same_batches(take(resumed, 6), reference[r])


def test_state_goes_through_dcp_and_stays_small(tmp_path, tok):
    path = write_token_folder(tmp_path / "t", token_docs(50))
    kw = dict(dataset=path, batch_size=2, seq_len=16, seed=5)
    loader = build(tok, **kw)
    it = iter(loader)
    for _ in range(5):
        next(it)
    dcp.save({"dataloader": loader}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = [next(it) for _ in range(4)]
    resumed = build(tok, **kw)
    dcp.load({"dataloader": resumed}, checkpoint_id=str(tmp_path / "ckpt"))
    assert same_batches(take(resumed, 4), expected)
    assert len(loader.state_dict()[STATE_KEY]) < 2000


def _elastic(tok, kw, before, after, n_before, n_after, docs, bos, eos):
    (w0, nw0), (w1, nw1) = before, after
    first = [build(tok, r, w0, num_workers=nw0, **kw) for r in range(w0)]
    batches = []
    for L in first:
        batches += take(L, n_before)
    saved = global_state(first)
    for r in range(w1):
        L = build(tok, r, w1, num_workers=nw1, **kw)
        L.load_state_dict({STATE_KEY: json.dumps(saved)})
        batches += take(L, n_after)
    for b in batches:
        check_batch_content(b, [docs], bos, eos)
    cov = coverage(b["_trace"] for b in batches)
    assert_no_overlap(cov)  # nothing repeated, not even parts of documents
    epoch0 = {k for k in cov if k[2] == 0}
    assert epoch0 == {(0, d, 0) for d in range(len(docs))}
    lengths = {(0, d): len(r) + (bos is not None) + (eos is not None) for d, r in enumerate(docs)}
    assert complete_docs(cov, lengths) >= epoch0  # nothing skipped
    return batches


def test_another_jobs_data_position_is_a_one_line_error(tmp_path, tok):
    """A checkpoint saved with other sources (another job's dump folder) is bad input, not a crash."""
    a = write_jsonl(tmp_path / "a.jsonl", text_docs(20, seed=1, prefix="a"))
    b = write_jsonl(tmp_path / "b.jsonl", text_docs(20, seed=2, prefix="b"))
    saved = build(tok, dataset=a, batch_size=2, seq_len=16)
    next(iter(saved))
    dcp.save({"dataloader": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    other = build(tok, dataset=f"{a},{b}", batch_size=2, seq_len=16)
    with pytest.raises(ConfigError, match=r"saved with 1 sources .*this run has 2 .*own --job.dump_folder"):
        dcp.load({"dataloader": other}, checkpoint_id=str(tmp_path / "ckpt"))


@pytest.mark.parametrize("kind", ["text", "tokens"])
@pytest.mark.parametrize("before,after", [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 1)), ((1, 1), (2, 1))])
def test_elastic_resume_neither_repeats_nor_skips(tmp_path, tok, kind, before, after):
    if kind == "text":
        texts = text_docs(40, seed=4)
        path = write_jsonl(tmp_path / "c.jsonl", texts)
        docs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        docs = token_docs(40, seed=4)
        path = write_token_folder(tmp_path / "t", docs)
    kw = dict(dataset=path, batch_size=2, seq_len=20, seed=11, varlen=True, context_len=20)
    per_epoch = sum(len(d) + 2 for d in docs) // 40  # batches of 40 tokens per epoch
    V0, V1 = before[0] * before[1], after[0] * after[1]
    n_before = max(2, per_epoch // 3 // before[0])
    n_after = (per_epoch * 2) // after[0] + 6 * V1
    _elastic(tok, kw, before, after, n_before, n_after, docs, tok.bos_token_id, tok.eos_token_id)
    assert V0 != V1


def test_elastic_twice_folds_layers(tmp_path, tok):
    docs = token_docs(60, seed=9)
    path = write_token_folder(tmp_path / "t", docs)
    kw = dict(dataset=path, batch_size=1, seq_len=16, seed=1)
    s = None
    traces = []
    for world in (2, 3, 1):
        loaders = [build(tok, r, world, **kw) for r in range(world)]
        for L in loaders:
            if s is not None:
                L.load_state_dict({STATE_KEY: json.dumps(s)})
            traces += [b["_trace"] for b in take(L, 10)]
        s = global_state(loaders)
    assert_no_overlap(coverage(traces))
    assert len(s["layouts"][0]) <= 2


def _dist_worker(rank, path, store, out_q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        tok = tokenizer()
        loader = build(tok, rank, 2, dataset=path, batch_size=2, seq_len=16, seed=1)
        take(loader, 3 + rank)  # ranks at different positions
        out_q.put((rank, loader.state_dict()[STATE_KEY]))
    finally:
        dist.destroy_process_group()


def test_distributed_state_is_identical_on_every_rank(tmp_path):
    import multiprocessing as mp

    path = write_token_folder(tmp_path / "t", token_docs(40))
    # spawn, not fork: a child forked from a test worker inherits whatever earlier tests compiled
    # (inductor's C++ kernels) and has crashed collecting it
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker, args=(r, path, str(tmp_path / "store"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[0] == got[1]
    state = json.loads(got[0])
    assert sorted(state["consumers"]) == ["0", "1"]
    assert [state["consumers"][k]["batches"] for k in ("0", "1")] == [3, 4]


def test_streaming_mixture_resumes_exactly_after_every_batch(tmp_path, tok):
    # Two streaming sources: the source that is not being emitted at the save point resumes from its
    # saved stream position alone (the current document's source is rewound separately).
    a = write_jsonl(tmp_path / "a.jsonl", text_docs(30, seed=5, prefix="a"))
    b = write_jsonl(tmp_path / "b.jsonl", text_docs(30, seed=6, prefix="b"))
    kw = dict(dataset=f"{a},{b}", data_probs=[0.5, 0.5], batch_size=2, seq_len=12, seed=7, streaming=True,
              shuffle_buffer_size=8)
    reference = take(build(tok, **kw), 12)
    for n in range(1, 9):
        first = build(tok, **kw)
        take(first, n)
        resumed = build(tok, **kw)
        resumed.load_state_dict(first.state_dict())
        assert same_batches(take(resumed, 4), reference[n:n + 4]), n
