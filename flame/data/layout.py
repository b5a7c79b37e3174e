"""Which document of a source each consumer reads, and how that survives a change of world size.

A *consumer* is one (data-parallel rank, dataloader worker) pair; there are V = dp_world_size *
max(1, num_workers) of them. Each map-style source has one infinite *document stream*: ordinal j
is document ``perm_epoch(j % N)`` of epoch ``j // N``. Consumer v reads stream positions
v, v + V, v + 2V, ... (its *share*), so consumers are disjoint and together cover every position.

A checkpoint records, per consumer, how many documents of its share it has taken. When a run
resumes with another V, the positions that were not taken yet (the slow consumers' tails, and
documents that were only partly emitted, with their token offset) become a new stream that the new
consumers share the same way: a :class:`Layer`. Layers stack; a layer whose explicit part has been
read entirely is folded into the one above it, so the stack stays as short as the number of recent
resizes and its size is O(old V), never O(documents).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Layer:
    """Positions not yet taken by V consumers with the given counts, read in stream order.

    ``taken[v]`` documents of consumer v's share were taken entirely. ``offsets`` maps a parent
    position (already including ``shift``) to the number of its tokens already emitted. The layer
    reads parent position ``shift + x`` for its local positions x.
    """

    V: int
    taken: list[int]
    offsets: dict[int, int] = field(default_factory=dict)
    shift: int = 0

    def __post_init__(self) -> None:
        self.taken = [int(t) for t in self.taken]
        self.offsets = {int(k): int(v) for k, v in self.offsets.items()}
        lo, hi = min(self.taken), max(self.taken)
        self.lo, self.hi = self.V * lo, self.V * hi
        if hi > lo:
            j = np.arange(self.lo, self.hi, dtype=np.int64)
            keep = (j // self.V) >= np.asarray(self.taken, dtype=np.int64)[j % self.V]
            self.explicit = j[keep]
        else:
            self.explicit = np.zeros(0, dtype=np.int64)

    def parent(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.int64)
        n = len(self.explicit)
        out = self.hi + (k - n)
        inside = k < n
        if inside.any():
            out = out.copy()
            out[inside] = self.explicit[k[inside]]
        return out + self.shift

    def to_state(self) -> dict:
        return {"V": self.V, "taken": self.taken, "offsets": [[k, v] for k, v in sorted(self.offsets.items())],
                "shift": self.shift}

    @classmethod
    def from_state(cls, s: dict) -> "Layer":
        return cls(V=int(s["V"]), taken=list(s["taken"]), offsets={k: v for k, v in s["offsets"]},
                   shift=int(s.get("shift", 0)))


class Layout:
    """The stack of layers of one map-style source: maps a consumer's share index to a base ordinal."""

    def __init__(self, layers: list[Layer] | None = None):
        self.layers = list(layers or [])

    def resolve(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Base ordinals and start offsets (tokens to skip) of top-level positions k."""
        pos = np.asarray(k, dtype=np.int64)
        offs = np.zeros(len(pos), dtype=np.int64)
        found = np.zeros(len(pos), dtype=bool)
        for layer in reversed(self.layers):
            pos = layer.parent(pos)
            if layer.offsets:
                for i, p in enumerate(pos):
                    if not found[i] and int(p) in layer.offsets:
                        offs[i] = layer.offsets[int(p)]
                        found[i] = True
        return pos, offs

    def share(self, v: int, V: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Base ordinals/offsets of consumer v's share entries start..start+count-1."""
        k = (np.arange(start, start + count, dtype=np.int64) * V) + v
        return self.resolve(k)

    def push(self, V: int, taken: list[int], offsets: dict[int, int]) -> None:
        """Record the end state of a geometry of V consumers and start a new stream above it."""
        new = Layer(V=V, taken=taken, offsets=offsets)
        if new.hi == 0 and not new.offsets:
            return  # nothing was taken: the identity
        # Fold the layer below into the new one while the new one no longer reaches its explicit
        # part (nor the positions where the old consumers had partial documents).
        while self.layers:
            below = self.layers[-1]
            if new.shift + new.lo < len(below.explicit) + below.V:
                break
            delta = below.shift + below.hi - len(below.explicit)
            new = Layer(V=new.V, taken=new.taken, offsets={k + delta: o for k, o in new.offsets.items()},
                        shift=new.shift + delta)
            self.layers.pop()
        self.layers.append(new)

    def to_state(self) -> list[dict]:
        return [layer.to_state() for layer in self.layers]

    @classmethod
    def from_state(cls, s: list[dict]) -> "Layout":
        return cls([Layer.from_state(x) for x in s])
