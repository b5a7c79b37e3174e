"""Conversations for supervised fine-tuning: rows in three formats -> messages -> token ids with a
mask of the tokens the model is trained to produce (the assistant's).

Formats, recognized per row from its fields (so one file may mix them):

- chat: ``messages``, a list of ``{"role", "content"}`` with roles system, user, assistant, tool;
- sharegpt: ``conversations``, a list of ``{"from", "value"}`` with ``from`` in human/user,
  gpt/assistant, system, tool;
- alpaca: ``instruction`` with ``output`` (and an optional ``input``, appended to the instruction
  after a blank line; an optional ``system``).

Rendering: the tokenizer's chat template (``tokenizer.apply_chat_template``), or flame's bundled
``flame/assets/chat_template.jinja`` when the tokenizer has none. The text an assistant turn adds is
``render(messages[:i+1])`` minus ``render(messages[:i], add_generation_prompt=True)`` (its content
and whatever the template closes the turn with, e.g. EOS); the whole conversation is then tokenized
once, and a token is trained when any of its characters lies in such a span (a token that merges the
header's last character with the content's first is trained). The template must render a
conversation's prefixes as prefixes of the whole (templates that rewrite earlier turns, e.g. ones
that drop past reasoning, are refused with one line).

Truncation: a conversation longer than the longest sequence the packer can place (``max_len``) keeps
its first ``max_len`` tokens; one with no trained token left after that is a bad row.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from flame.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
# Columns a conversation can come from; a source needs at least one of these sets.
FORMAT_COLUMNS = {"chat": ("messages",), "sharegpt": ("conversations",),
                  "alpaca": ("instruction", "input", "output", "system")}
DEFAULT_TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "chat_template.jinja")


class BadConversation(ValueError):
    """A row that gives no trainable conversation; the message says why."""


class Conversation:
    """Token ids of one rendered conversation and which of them are trained (assistant tokens).

    ``at(pos)`` mirrors :class:`flame.data.documents.Doc`: whether token ``pos`` exists."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)
        self.trained = np.asarray(trained, dtype=bool)

    def __len__(self) -> int:
        return len(self.ids)

    def at(self, pos: int) -> bool:
        return pos < len(self.ids)

    def labels(self) -> np.ndarray:
        """Shifted targets: ``labels[t]`` is ``ids[t + 1]`` where that token is trained, else -100;
        the last position predicts nothing (the next conversation is not its continuation)."""
        out = np.full(len(self.ids), -100, dtype=np.int64)
        out[:-1] = np.where(self.trained[1:], self.ids[1:], -100)
        return out


def format_columns(columns: Sequence[str], where: str) -> list[str]:
    """The columns of ``columns`` that conversations are read from (a one-line error if none)."""
    keep = [c for cols in FORMAT_COLUMNS.values() for c in cols if c in columns]
    if not any(c in columns for c in ("messages", "conversations", "instruction")):
        raise ConfigError(f"training.sft: {where} has none of the columns 'messages' (chat), 'conversations' "
                          f"(sharegpt) or 'instruction'/'output' (alpaca); it has {list(columns)}")
    return keep


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise BadConversation(f"{what} is {type(value).__name__}, not text")
    return value


def messages_of(row: dict) -> list[dict]:
    """The row as ``[{"role", "content"}]`` (chat roles), whichever format it has."""
    if row.get("messages") is not None:
        turns, role_key, text_key, roles = row["messages"], "role", "content", {r: r for r in ROLES}
    elif row.get("conversations") is not None:
        turns, role_key, text_key, roles = row["conversations"], "from", "value", SHAREGPT_ROLES
    elif row.get("instruction") is not None:
        user = _text(row["instruction"], "'instruction'")
        extra = row.get("input")
        if extra:
            user = f"{user}\n\n{_text(extra, repr('input'))}"
        out = [{"role": "user", "content": user},
               {"role": "assistant", "content": _text(row.get("output"), "'output'")}]
        if row.get("system"):
            out.insert(0, {"role": "system", "content": _text(row["system"], "'system'")})
        return _checked(out)
    else:
        raise BadConversation("unknown format (no 'messages', 'conversations' or 'instruction')")
    if not isinstance(turns, (list, tuple)) or not turns:
        raise BadConversation("no turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get(role_key) is None:
            raise BadConversation(f"turn {k + 1} has no {role_key!r}")
        role = roles.get(str(turn[role_key]).lower())
        if role is None:
            raise BadConversation(f"turn {k + 1} has the unknown role {turn[role_key]!r}")
        out.append({"role": role, "content": _text(turn.get(text_key), f"turn {k + 1}'s {text_key!r}")})
    return _checked(out)


def _checked(messages: list[dict]) -> list[dict]:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadConversation("no assistant turn")
    for k, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise BadConversation(f"turn {k + 1} is an empty assistant turn")
    return messages


class ChatRenderer:
    """Renders messages with a chat template and tokenizes them with the assistant mask."""

    def __init__(self, tokenizer: Any, max_len: int):
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(f"training.sft: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} is not a fast "
                              "tokenizer (character offsets are needed to find the assistant tokens)")
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.template = None  # the tokenizer's own
        if not getattr(tokenizer, "chat_template", None):
            with open(DEFAULT_TEMPLATE_PATH) as f:
                self.template = f.read()

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except TemplateError as e:
            # templates refuse some conversations themselves (e.g. roles that do not alternate)
            raise BadConversation(f"the chat template refuses it ({e})") from None

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns."""
        text = self._render(messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._render(messages[:i], True)
            upto = self._render(messages[:i + 1], False)
            if not (upto.startswith(head) and text.startswith(upto)):
                raise ConfigError("training.sft: the chat template does not render a conversation's beginning as "
                                  "the beginning of the whole (it rewrites earlier turns), so assistant tokens "
                                  "cannot be located; use a template without that behaviour")
            spans.append((len(head), len(upto)))
        return text, spans

    def __call__(self, messages: list[dict]) -> Conversation:
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                             return_attention_mask=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        trained = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            trained |= (offsets[:, 1] > a) & (offsets[:, 0] < b)  # any character inside the span
        ids, trained = ids[:self.max_len], trained[:self.max_len]
        if not trained[1:].any():  # position 0 is never a target
            raise BadConversation(f"no assistant token within the first {self.max_len} tokens (truncated)")
        return Conversation(ids, trained)

    def row(self, row: dict) -> Conversation:
        """One dataset row as a conversation (:class:`BadConversation` when it gives none)."""
        return self(messages_of(row))
