"""Stateless randomness: a seeded bijection of [0, n) and counter-based uniforms.

Both are pure functions of (seed, index), so any position of a shuffled epoch or of a mixing
sequence is computed directly, without storing a permutation (O(1) memory for any corpus size) and
without replaying an RNG on resume.
"""

from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer: a well-scrambled 64-bit hash of uint64 values (vectorized)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return x


def key_of(*parts: int) -> int:
    """Combine integers (seed, source, epoch, ...) into one 64-bit key."""
    h = np.uint64(0x243F6A8885A308D3)
    for p in parts:
        h = mix64(np.uint64(h) ^ mix64(np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF)))
    return int(h)


def uniforms(key: int, start: int, count: int) -> np.ndarray:
    """count uniforms in [0, 1) at positions start..start+count-1 of the stream named key."""
    idx = np.arange(start, start + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = mix64(idx ^ np.uint64(key)) ^ np.uint64(key >> 1)
        h = mix64(h)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class Permutation:
    """A pseudo-random bijection of [0, n): 4-round Feistel network with cycle walking."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("permutation of an empty range")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        bits += bits & 1
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(key_of(key, r)) for r in range(4)]

    def _round(self, x: np.ndarray) -> np.ndarray:
        left = x >> np.uint64(self.half)
        right = x & self.mask
        for k in self.keys:
            f = mix64(right ^ k) & self.mask
            left, right = right, left ^ f
        return (left << np.uint64(self.half)) | right

    def __call__(self, idx: np.ndarray | int) -> np.ndarray:
        x = np.atleast_1d(np.asarray(idx, dtype=np.uint64))
        if x.size and int(x.max()) >= self.n:
            raise IndexError("permutation index out of range")
        x = self._round(x)
        # The Feistel domain is at most 4n, so a few walks bring every value back into [0, n).
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = self._round(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)
