"""SFT data (training.sft): formats, the assistant-only label mask, packing, bad rows, exact resume."""

import json
import logging

import datasets
import pytest
import torch
from flame_data_testlib import REPO, assert_no_overlap, assert_quiet, build, coverage, same_batches, take

from flame.data.chat import BadConversation, ChatRenderer, messages_of
from flame.data.loader import STATE_KEY
from flame.errors import ConfigError

SAMPLE = REPO / "flame" / "assets" / "sft_sample"
HAND = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok"}]


def word_tokenizer():
    """A word-level tokenizer whose ids are known by hand (no chat template: flame's bundled one applies)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + ["hi", "hello", "there", "bye", "ok", "[UNK]"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="[UNK]", additional_special_tokens=specials[3:])
    assert not tok.chat_template
    return tok


def write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_hand_built_conversation_label_tensor(tmp_path):
    tok = word_tokenizer()
    data = write_rows(tmp_path / "c.jsonl", [{"messages": HAND}])
    batch = take(build(tok, dataset=data, sft=True, batch_size=1, seq_len=16, shuffle=False), 1)[0]
    # <s> <|user|> hi </s> <|assistant|> hello there </s> <|user|> bye </s> <|assistant|> ok </s> <pad> <pad>
    assert batch["input_ids"].tolist() == [[0, 3, 6, 1, 4, 7, 8, 1, 3, 9, 1, 4, 10, 1, 2, 2]]
    # labels[t] = the next token where it is an assistant token (content and the closing </s>), else -100
    x = -100
    assert batch["labels"].tolist() == [[x, x, x, x, 7, 8, 1, x, x, x, x, 10, 1, x, x, x]]


def test_truncation_keeps_the_first_tokens_and_drops_rows_without_targets(tmp_path):
    tok = word_tokenizer()
    conv = ChatRenderer(tok, max_len=6)(HAND)  # <s> <|user|> hi </s> <|assistant|> hello
    assert conv.ids.tolist() == [0, 3, 6, 1, 4, 7] and conv.labels().tolist() == [-100] * 4 + [7, -100]
    with pytest.raises(BadConversation, match="first 4 tokens"):
        ChatRenderer(tok, max_len=4)(HAND)


def test_three_formats_give_the_same_conversation(tok):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: b a"},
                         {"role": "assistant", "content": "a b"}]}
    alpaca = {"instruction": "Sort:", "input": "b a", "output": "a b", "system": "Be brief."}
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Sort: b a"},
                                  {"from": "gpt", "value": "a b"}]}
    assert messages_of(sharegpt) == chat["messages"]
    assert messages_of(alpaca)[1]["content"] == "Sort:\n\nb a"
    render = ChatRenderer(tok, max_len=256)
    a, s = render.row(chat), render.row(sharegpt)
    assert a.ids.tolist() == s.ids.tolist() and a.labels().tolist() == s.labels().tolist()
    trained = a.labels()[a.labels() != -100]
    assert tok.decode(trained) == "a b</s>"


@pytest.mark.parametrize("name", ["chat", "alpaca", "sharegpt"])
def test_bundled_sample_trains_exactly_the_assistant_turns(tok, name):
    rows = [json.loads(line) for line in open(SAMPLE / f"{name}.jsonl")][:40]
    render = ChatRenderer(tok, max_len=512)
    for row in rows:
        conv = render.row(row)
        want = "".join(m["content"] + "</s>" for m in messages_of(row) if m["role"] == "assistant")
        labels = conv.labels()
        assert tok.decode(labels[labels != -100]) == want


def test_varlen_packs_whole_conversations_apart(tok):
    data = ",".join(str(SAMPLE / f"{n}.jsonl") for n in ("chat", "alpaca", "sharegpt"))
    kw = dict(dataset=data, sft=True, batch_size=2, seq_len=128, varlen=True, context_len=64, seed=1)
    for batch in take(build(tok, **kw), 4):
        ids, labels, cu = batch["input_ids"].flatten(), batch["labels"].flatten(), batch["cu_seqlens"].tolist()
        pieces = list(zip(cu, cu[1:]))
        assert all(b - a <= 64 for a, b in pieces)
        for a, b in pieces:
            text = tok.decode(ids[a:b])
            # a piece is one conversation from <s> to its last </s> (or cut at 64 tokens), or padding
            assert (text.startswith("<s><|") and (text.endswith("</s>") or b - a == 64) and text.count("<s>") == 1
                    or set(ids[a:b].tolist()) == {tok.pad_token_id}), text
            assert labels[b - 1] == -100  # nothing is predicted across conversations
            assert batch["position_ids"].flatten()[a:b].tolist() == list(range(b - a))


def test_without_varlen_a_row_holds_one_padded_conversation(tok):
    kw = dict(dataset=str(SAMPLE / "chat.jsonl"), sft=True, batch_size=4, seq_len=96, seed=2)
    batch = take(build(tok, **kw), 1)[0]
    assert "cu_seqlens" not in batch
    for ids in batch["input_ids"]:
        assert (ids == tok.bos_token_id).sum() == 1 and ids[0] == tok.bos_token_id


def test_bad_rows_are_counted_and_skipped_with_one_log_line(tmp_path, tok, caplog):
    good = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}
    bad = [
        {"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "narrator", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"text": "a row of another format"},
    ]
    data = write_rows(tmp_path / "mixed.jsonl", [good, *bad, good])
    caplog.set_level(logging.WARNING)
    loader = build(tok, dataset=data, sft=True, batch_size=1, seq_len=64, shuffle=False)
    batches = take(loader, 2)
    assert loader.bad_document_counts() == {data: len(bad)}
    for b in batches:
        labels = b["labels"][0]
        assert tok.decode(labels[labels != -100]) == "Blue.</s>"
    lines = [r.getMessage() for r in caplog.records if "bad_document_policy" in r.getMessage()]
    assert len(lines) == 1 and "mixed.jsonl, row 2" in lines[0] and "'role'" in lines[0], lines
    with pytest.raises(ConfigError, match="row 2: turn 1 has no 'role'"):
        take(build(tok, dataset=data, sft=True, batch_size=1, seq_len=64, shuffle=False,
                   bad_document_policy="error"), 1)


def test_a_conversation_the_template_refuses_is_a_bad_row():
    tok = word_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }} {% endfor %}")
    render = ChatRenderer(tok, max_len=64)
    assert render(HAND).ids.tolist() == [6, 7, 8, 9, 10]  # the tokenizer's own template, not the bundled one
    with pytest.raises(BadConversation, match="roles must alternate"):
        render([HAND[1], HAND[0], HAND[1]])


def test_a_source_of_another_format_is_one_line(tmp_path, tok, capfd, caplog):
    datasets.enable_progress_bar()
    data = write_rows(tmp_path / "t.jsonl", [{"text": "plain text"}])  # a new file: datasets converts it
    with pytest.raises(ConfigError, match="none of the columns 'messages'"):
        build(tok, dataset=data, sft=True)
    assert_quiet(capfd, caplog)  # datasets' "Generating train split" bars came before the error line


@pytest.mark.parametrize("varlen,streaming,world", [(True, False, 2), (False, False, 1), (True, True, 1)])
def test_exact_resume(tok, varlen, streaming, world):
    data = ",".join(str(SAMPLE / f"{n}.jsonl") for n in ("chat", "alpaca", "sharegpt"))
    kw = dict(dataset=data, data_probs=[0.5, 0.25, 0.25], sft=True, batch_size=2, seq_len=96, varlen=varlen,
              context_len=48, seed=4, streaming=streaming, shuffle_buffer_size=16)
    from flame.data import state as gstate

    first = [build(tok, r, world, **kw) for r in range(world)]
    its = [iter(L) for L in first]
    for _ in range(3):
        for it in its:
            next(it)
    saved = gstate.merge([json.loads(L.state_dict()[STATE_KEY]) for L in first])
    assert any(c["cur"] is not None for c in saved["consumers"].values())  # a conversation waits for its row
    reference = [[next(it) for _ in range(5)] for it in its]
    for r in range(world):
        resumed = build(tok, r, world, **kw)
        resumed.load_state_dict({STATE_KEY: json.dumps(saved)})
        assert same_batches(take(resumed, 5), reference[r])
    assert not torch.equal(reference[0][0]["input_ids"], reference[0][1]["input_ids"])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_elastic_resume_neither_repeats_nor_skips_a_conversation(tok, before, after):
    kw = dict(dataset=str(SAMPLE / "chat.jsonl"), sft=True, batch_size=2, seq_len=128, varlen=True, context_len=64,
              seed=5)
    from flame.data import state as gstate

    first = [build(tok, r, before, **kw) for r in range(before)]
    batches = [b for L in first for b in take(L, 6)]
    saved = gstate.merge([json.loads(L.state_dict()[STATE_KEY]) for L in first])
    for r in range(after):
        resumed = build(tok, r, after, **kw)
        resumed.load_state_dict({STATE_KEY: json.dumps(saved)})
        batches += take(resumed, 160 // after)
    cov = coverage(b["_trace"] for b in batches)
    assert_no_overlap(cov)  # no conversation twice in an epoch
    render, usable = ChatRenderer(tok, max_len=64), set()
    for d, line in enumerate(open(SAMPLE / "chat.jsonl")):
        try:
            render.row(json.loads(line))
            usable.add((0, d, 0))
        except BadConversation:
            pass  # no assistant token in its first 64 tokens
    assert 290 < len(usable) < 300 and {k for k in cov if k[2] == 0} == usable  # none skipped
