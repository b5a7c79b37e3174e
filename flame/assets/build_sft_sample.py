"""Writes ``flame/assets/sft_sample/``: short conversations for trying ``training.sft`` offline.

``python -m flame.assets.build_sft_sample`` regenerates the three files deterministically (a fixed
seed; no download): ``chat.jsonl`` (``messages``), ``alpaca.jsonl`` (``instruction``/``input``/
``output``) and ``sharegpt.jsonl`` (``conversations``). The tasks are small and rule-based (sums and
products, reversing, sorting and counting words, naming the section of the bundled Python
documentation a heading belongs to), so a tiny model's loss on the answers falls within a few dozen
steps.
"""

from __future__ import annotations

import gzip
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "sft_sample")
WORDS = ("apple river stone cloud maple tiger violet copper lantern meadow harbor falcon willow ember "
         "canyon pepper summit velvet orbit quartz").split()
SYSTEM = "You are a concise assistant."


def _heading(text: str) -> str | None:
    """The first reStructuredText heading of a document (a line underlined with = - * ~ ^)."""
    lines = text.splitlines()
    for line, under in zip(lines, lines[1:]):
        line, under = line.strip(), under.strip()
        if line and len(under) >= 3 and len(set(under)) == 1 and under[0] in "=-*~^" and line[0] not in "=-*~^.":
            return line
    return None


def _headings(limit: int) -> list[tuple[str, str]]:
    """(section heading, documentation file) pairs of the bundled corpus, in file order."""
    out, seen = [], set()
    with gzip.open(os.path.join(HERE, "sample_corpus", "train.jsonl.gz"), "rt") as f:
        for line in f:
            doc = json.loads(line)
            section = _heading(doc["text"])
            if section and section not in seen and len(section) < 60:
                seen.add(section)
                out.append((section, doc["id"].partition("#")[0]))
            if len(out) >= limit:
                break
    return out


def _qa(rng: random.Random, headings: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One to three (question, answer) turns on one task."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        return [(f"What is {a} + {b}?", f"{a} + {b} = {a + b}."),
                (f"And {a} times {b}?", f"{a} * {b} = {a * b}.")][:rng.randrange(1, 3)]
    words = rng.sample(WORDS, rng.randrange(3, 7))
    listed = " ".join(words)
    if kind == 1:
        return [(f"Reverse these words: {listed}", " ".join(reversed(words))),
                ("How many words was that?", f"{len(words)} words.")][:rng.randrange(1, 3)]
    if kind == 2:
        return [(f"Sort these words alphabetically: {listed}", " ".join(sorted(words))),
                ("Which one comes first?", f"{min(words)} comes first.")][:rng.randrange(1, 3)]
    section, path = headings[rng.randrange(len(headings))]
    return [(f"Which file of the Python 3.11 documentation has the section \"{section}\"?", f"{path}.")]


def build(seed: int = 0, chat: int = 300, alpaca: int = 100, sharegpt: int = 100) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    headings = _headings(200)
    rows: dict[str, list[dict]] = {"chat": [], "alpaca": [], "sharegpt": []}
    for _ in range(chat):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        for q, a in _qa(rng, headings):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows["chat"].append({"messages": messages})
    for _ in range(alpaca):
        q, a = _qa(rng, headings)[0]
        instruction, _, rest = q.partition(": ")
        rows["alpaca"].append({"instruction": instruction + (":" if rest else ""), "input": rest, "output": a})
    for _ in range(sharegpt):
        turns = []
        for q, a in _qa(rng, headings):
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rows["sharegpt"].append({"conversations": turns})
    return rows


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    for name, rows in build().items():
        with open(os.path.join(OUT, f"{name}.jsonl"), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{OUT}/{name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
