"""Ranks and workers read disjoint documents that together cover each epoch exactly once."""

from flame_data_testlib import (
    assert_no_overlap,
    build,
    check_batch_content,
    complete_docs,
    coverage,
    take,
    text_docs,
    write_jsonl,
)


def test_two_ranks_two_workers_cover_epoch_once(tmp_path, tok):
    texts = text_docs(60)
    path = write_jsonl(tmp_path / "corpus" / "train.jsonl", texts)
    raw = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    batches = []
    for rank in range(2):
        loader = build(tok, rank, 2, dataset=path, batch_size=2, seq_len=32, num_workers=2, prefetch_factor=2,
                       persistent_workers=True, varlen=True, context_len=16)
        got = take(loader, 36)
        assert {b["_consumer"] for b in got} == {rank * 2, rank * 2 + 1}
        batches += got
    for b in batches:
        check_batch_content(b, [raw], tok.bos_token_id, tok.eos_token_id)
    cov = coverage(b["_trace"] for b in batches)
    assert_no_overlap(cov)
    # Every consumer has moved on to epoch 1, so epoch 0 is complete: each document exactly once.
    assert {c for b in batches for c in [b["_consumer"]] if any(t[2] == 1 for t in b["_trace"])} == {0, 1, 2, 3}
    lengths = {(0, d): len(r) + 2 for d, r in enumerate(raw)}
    epoch0 = {k for k in cov if k[2] == 0}
    assert epoch0 == {(0, d, 0) for d in range(60)}
    assert complete_docs(cov, lengths) >= epoch0
    # Epoch 1 is a different order than epoch 0 (reshuffled, not replayed).
    order = {e: [t[1] for b in batches if b["_consumer"] == 0 for t in b["_trace"] if t[2] == e and t[3] == 0]
             for e in (0, 1)}
    n = min(len(order[0]), len(order[1]))
    assert n >= 3 and order[0][:n] != order[1][:n]


def test_tp_peers_of_one_dp_rank_get_the_same_batches(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", text_docs(20))
    a = take(build(tok, 1, 2, dataset=path, seq_len=16, seed=7), 4)
    b = take(build(tok, 1, 2, dataset=path, seq_len=16, seed=7), 4)
    c = take(build(tok, 0, 2, dataset=path, seq_len=16, seed=7), 4)
    from flame_data_testlib import same_batches

    assert same_batches(a, b)
    assert not same_batches(a, c)
