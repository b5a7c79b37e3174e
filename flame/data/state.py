"""The loader's checkpoint state: one global position, the same on every rank.

It holds, per source, the layout (map-style) or stream anchor (streaming), and per consumer its
few counters. Ranks contribute their own consumers; :func:`merge` joins them (after an
all-gather in a distributed run), so the saved value is identical on every rank and DCP keeps one
copy. :func:`reshard` turns a state saved with V consumers into the start of a run with V':
map-style sources lose and repeat nothing (see :mod:`flame.data.layout`); streaming sources
restart at the slowest consumer's position (see the guarantees in README_SECTION.md).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from flame.data.layout import Layout
from flame.errors import ConfigError

VERSION = 1


def fresh(source_names: Sequence[str], streaming: Sequence[bool], dp_world_size: int, num_workers: int) -> dict:
    n = max(1, num_workers)
    return {
        "version": VERSION,
        "dp_world_size": dp_world_size,
        "num_workers": n,
        "V": dp_world_size * n,
        "sources": list(source_names),
        "gen": 0,
        "layouts": [None if s else [] for s in streaming],
        "streams": [{"epoch": 0, "base": 0} if s else None for s in streaming],
        "tokens_base": [0] * len(source_names),
        "bad_base": [0] * len(source_names),
        "consumers": {},
        "next_worker": {},
    }


def merge(parts: Sequence[dict]) -> dict:
    """Join the per-rank views (each has the shared fields plus its own consumers)."""
    out = copy.deepcopy(parts[0])
    for p in parts[1:]:
        out["consumers"].update(p["consumers"])
        out["next_worker"].update(p["next_worker"])
    out["consumers"] = dict(sorted(out["consumers"].items(), key=lambda kv: int(kv[0])))
    out["next_worker"] = dict(sorted(out["next_worker"].items(), key=lambda kv: int(kv[0])))
    return out


def token_totals(state: dict) -> list[int]:
    tot = list(state["tokens_base"])
    for c in state["consumers"].values():
        for i, t in enumerate(c["tokens"]):
            tot[i] += int(t)
    return tot


def bad_totals(state: dict) -> list[int]:
    """Bad rows (skipped or replaced) met per source so far."""
    tot = list(state.get("bad_base", [0] * len(state["sources"])))
    for c in state["consumers"].values():
        for i, t in enumerate(c.get("bad", [])):
            tot[i] += int(t)
    return tot


def reshard(state: dict, dp_world_size: int, num_workers: int) -> tuple[dict, bool]:
    """Adapt a saved state to a new geometry. Returns (state, exact) where exact means the
    geometry is unchanged, so batches continue exactly as in an uninterrupted run."""
    n = max(1, num_workers)
    V = dp_world_size * n
    same = state["dp_world_size"] == dp_world_size and state["num_workers"] == n
    if same:
        return state, True
    out = copy.deepcopy(state)
    out.update(dp_world_size=dp_world_size, num_workers=n, next_worker={})
    if state["V"] == V:
        # Same number of consumers: consumer v keeps its state, only its (rank, worker) changes.
        return out, False
    V0 = state["V"]
    consumers = {int(k): c for k, c in state["consumers"].items()}
    for i, layout_state in enumerate(state["layouts"]):
        if layout_state is None:
            continue
        taken, offsets = [], {}
        for v in range(V0):
            c = consumers.get(v)
            t = int(c["taken"][i]) if c else 0
            if c and c["cur"] is not None and int(c["cur"][0]) == i:
                t -= 1  # the current document is not finished: it goes back to the stream
                if int(c["cur"][1]) > 0:
                    offsets[t * V0 + v] = int(c["cur"][1])
            taken.append(t)
        layout = Layout.from_state(layout_state)
        layout.push(V0, taken, offsets)
        out["layouts"][i] = layout.to_state()
    for i, anchor in enumerate(state["streams"]):
        if anchor is None:
            continue
        positions = []
        for v in range(V0):
            c = consumers.get(v)
            if c is None or c["stream"][i] is None:
                positions.append((int(anchor["epoch"]), int(anchor["base"])))
                continue
            s = c["stream"][i]
            pos = int(c["cur"][2]) if c["cur"] is not None and int(c["cur"][0]) == i else int(s["pos"])
            positions.append((int(s["epoch"]), pos))
        epoch, base = min(positions)
        out["streams"][i] = {"epoch": epoch, "base": base}
    out["tokens_base"] = token_totals(state)
    out["bad_base"] = bad_totals(state)
    out["consumers"] = {}
    out["gen"] = int(state["gen"]) + 1
    out["V"] = V
    return out, False


def check_compatible(state: dict, source_names: Sequence[str]) -> None:
    """A ConfigError (one line, exit 2) when a resumed checkpoint's data position cannot serve this
    run's sources: typically another job launched into an existing dump folder."""
    if int(state.get("version", -1)) != VERSION:
        raise ConfigError(f"dataloader state version {state.get('version')!r} in the checkpoint is not {VERSION}")
    if len(state["sources"]) != len(source_names):
        raise ConfigError(
            f"the checkpoint's data position was saved with {len(state['sources'])} sources {state['sources']}, "
            f"this run has {len(source_names)} {list(source_names)}; the data position cannot be carried over "
            "(another job in this dump folder? give this one its own --job.dump_folder)"
        )


def summary(state: dict) -> dict[str, Any]:
    return {"tokens": dict(zip(state["sources"], token_totals(state))),
            "bad_documents": dict(zip(state["sources"], bad_totals(state))), "V": state["V"], "gen": state["gen"]}
