"""Rebuild the bundled sample corpus and tokenizer (maintainers only; the outputs are committed).

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python -m flame.assets.build_assets --sources /tmp/pydoc/usr/share/doc/python3.11/html/_sources

The corpus is the reStructuredText source of the Python 3.11 documentation (PSF License, see
README.md). Each file is cut at its section headings into documents of a few KB, so the corpus has
many documents of varied length, which is what packing and document boundaries need to be exercised.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
CORPUS_DIR = ASSETS / "sample_corpus"
TOKENIZER_DIR = ASSETS / "tokenizer"

# A heading is a text line followed by a line made of one repeated punctuation character.
_UNDERLINE = re.compile(r"^([=\-~^*#+\"'`])\1{2,}\s*$")
_MIN_DOC_CHARS = 400
_VALIDATION_PERCENT = 2


def split_sections(text: str) -> list[str]:
    """Cut one rst file at its headings; merge short pieces into the following one."""
    lines = text.splitlines()
    cuts = [0]
    for i in range(1, len(lines)):
        if _UNDERLINE.match(lines[i]) and lines[i - 1].strip() and not _UNDERLINE.match(lines[i - 1]):
            start = i - 1
            # An overline above the title belongs to the same heading.
            if start > 0 and _UNDERLINE.match(lines[start - 1]):
                start -= 1
            if start > cuts[-1]:
                cuts.append(start)
    cuts.append(len(lines))
    docs, pending = [], ""
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = "\n".join(lines[a:b]).strip()
        pending = f"{pending}\n\n{piece}".strip() if pending else piece
        if len(pending) >= _MIN_DOC_CHARS:
            docs.append(pending)
            pending = ""
    if pending:
        if docs:
            docs[-1] = f"{docs[-1]}\n\n{pending}"
        else:
            docs.append(pending)
    return docs


def build_corpus(sources: Path) -> tuple[int, int]:
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in sources.rglob("*.rst.txt") if "changelog" not in p.name)
    n_train = n_val = 0
    with gzip.open(CORPUS_DIR / "train.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as ftr, gzip.open(
        CORPUS_DIR / "validation.jsonl.gz", "wt", encoding="utf-8", compresslevel=9
    ) as fva:
        for path in files:
            rel = str(path.relative_to(sources)).removesuffix(".rst.txt")
            for k, text in enumerate(split_sections(path.read_text(encoding="utf-8"))):
                doc_id = f"{rel}#{k}"
                # Hash-based hold-out: stable regardless of file order.
                bucket = int(hashlib.sha1(doc_id.encode()).hexdigest(), 16) % 100
                row = json.dumps({"id": doc_id, "text": text}, ensure_ascii=False)
                if bucket < _VALIDATION_PERCENT:
                    fva.write(row + "\n")
                    n_val += 1
                else:
                    ftr.write(row + "\n")
                    n_train += 1
    return n_train, n_val


def build_tokenizer(vocab_size: int = 8192) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        with gzip.open(CORPUS_DIR / "train.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    # No post-processor: flame's data pipeline adds BOS/EOS itself (see flame/data/README_SECTION.md).
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(TOKENIZER_DIR))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=Path, required=True, help="the html/_sources folder of python3.11-doc")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    n_train, n_val = build_corpus(args.sources)
    print(f"corpus: {n_train} train / {n_val} validation documents")
    build_tokenizer(args.vocab_size)
    print(f"tokenizer saved to {TOKENIZER_DIR}")


if __name__ == "__main__":
    main()
