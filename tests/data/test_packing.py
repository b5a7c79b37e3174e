"""Exact packing, labels, cu_seqlens and positions on hand-built examples."""

import numpy as np
import pytest
import torch
from flame_data_testlib import TOKENIZER, build, write_token_folder
from transformers import AutoTokenizer

from flame.data.packing import pack_batch
from flame.data.tokenizer import boundary_tokens
from flame.errors import ConfigError


def test_pack_batch_varlen_context_split_and_batch_of_two():
    windows = np.arange(18).reshape(2, 9)
    starts = [[0, 5, 8], []]  # row 0: doc at 0, doc at 5, a doc begins at the peeked token 8
    out = pack_batch(windows, starts, varlen=True, context_len=3, mask_cross_document_labels=True)
    assert out["input_ids"].tolist() == [list(range(0, 8)), list(range(9, 17))]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 8, 11, 14, 16]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 0, 1, 2, 0, 1]]
    # Targets of positions 4 and 7 of row 0 are first tokens of other documents.
    assert out["labels"].tolist() == [[1, 2, 3, 4, -100, 6, 7, -100], list(range(10, 18))]


def test_pack_batch_fixed_length_has_no_varlen_keys():
    windows = np.arange(10).reshape(2, 5)
    out = pack_batch(windows, [[0, 2], [1]], varlen=False, context_len=4, mask_cross_document_labels=False)
    assert set(out) == {"input_ids", "labels"}
    assert out["labels"].tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]


def _tok(bos):
    if bos == "none":
        return AutoTokenizer.from_pretrained(TOKENIZER, bos_token=None)
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.mark.parametrize("with_bos", [True, False])
def test_consumer_varlen_exact(tmp_path, with_bos):
    raw = [[11, 12, 13], [21, 22, 23, 24, 25, 26], [31, 32]]
    folder = write_token_folder(tmp_path / "tok", raw)
    tok = _tok("bos" if with_bos else "none")
    loader = build(tok, dataset=folder, batch_size=2, seq_len=6, varlen=True, context_len=4, shuffle=False,
                   mask_cross_document_labels=True)
    b = next(iter(loader))
    if with_bos:  # documents: [0 11 12 13 1] [0 21 .. 26 1] [0 31 32 1]
        assert b["input_ids"].tolist() == [[0, 11, 12, 13, 1, 0], [21, 22, 23, 24, 25, 26]]
        assert b["labels"].tolist() == [[11, 12, 13, 1, -100, 21], [22, 23, 24, 25, 26, 1]]
        assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 1]]
        assert b["cu_seqlens"].tolist() == [0, 4, 5, 6, 10, 12]
    else:  # documents: [11 12 13 1] [21 .. 26 1] [31 32 1]
        assert b["input_ids"].tolist() == [[11, 12, 13, 1, 21, 22], [23, 24, 25, 26, 1, 31]]
        assert b["labels"].tolist() == [[12, 13, 1, -100, 22, 23], [24, 25, 26, 1, -100, 32]]
        assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 0]]
        assert b["cu_seqlens"].tolist() == [0, 4, 6, 10, 11, 12]


def test_long_document_split_into_context_pieces(tmp_path):
    folder = write_token_folder(tmp_path / "tok", [list(range(100, 120))])  # one 20-token document
    loader = build(_tok("bos"), dataset=folder, batch_size=1, seq_len=16, varlen=True, context_len=5,
                   shuffle=False, boundary_policy="none")
    b = next(iter(loader))
    assert b["input_ids"].tolist() == [list(range(100, 116))]
    assert b["cu_seqlens"].tolist() == [0, 5, 10, 15, 16]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4] * 3 + [0]]


def test_fixed_length_rows_are_contiguous_stream(tmp_path):
    raw = [[11, 12, 13], [21, 22, 23, 24]]
    folder = write_token_folder(tmp_path / "tok", raw)
    loader = build(_tok("bos"), dataset=folder, batch_size=2, seq_len=4, shuffle=False, boundary_policy="eos")
    it = iter(loader)
    b1, b2 = next(it), next(it)
    stream = [11, 12, 13, 1, 21, 22, 23, 24, 1] * 3
    flat = b1["input_ids"].flatten().tolist() + b2["input_ids"].flatten().tolist()
    assert flat == stream[:16]
    # Labels are the next stream token, also across rows and batches.
    assert b1["labels"].flatten().tolist() == stream[1:9]
    assert b2["labels"][1, -1].item() == stream[16]
    assert "cu_seqlens" not in b1


def test_boundary_policy_for_tokenizers_with_and_without_bos():
    class T:
        def __init__(self, bos, eos):
            self.bos_token_id, self.eos_token_id = bos, eos

    assert boundary_tokens(T(0, 1), "auto") == boundary_tokens(T(0, 1), "bos_eos")
    assert (boundary_tokens(T(0, 1), "auto").bos, boundary_tokens(T(0, 1), "auto").eos) == (0, 1)
    gpt2 = boundary_tokens(T(50256, 50256), "auto")  # BOS == EOS: one separator
    assert (gpt2.bos, gpt2.eos) == (None, 50256)
    qwen = boundary_tokens(T(None, 151643), "auto")
    assert (qwen.bos, qwen.eos) == (None, 151643)
    with pytest.raises(ConfigError, match="BOS"):
        boundary_tokens(T(None, 5), "bos")
    with pytest.raises(ConfigError, match="neither"):
        boundary_tokens(T(None, None), "auto")
