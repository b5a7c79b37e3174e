"""Stateless shuffling and the elastic layout (positions never lost nor repeated across resizes)."""

import numpy as np
import pytest

from flame.data.layout import Layout
from flame.data.permute import Permutation, key_of, uniforms


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_permutation_is_a_bijection_and_seeded(n):
    p = Permutation(n, key_of(1, 2, 3))
    out = p(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    if n > 16:
        assert out.tolist() != list(range(n))
        other = Permutation(n, key_of(1, 2, 4))(np.arange(n))
        assert other.tolist() != out.tolist()  # a new epoch gives a new order


def test_uniforms_are_positional_and_uniform():
    u = uniforms(123, 0, 20000)
    assert np.array_equal(uniforms(123, 500, 10), u[500:510])
    assert abs(u.mean() - 0.5) < 0.01 and u.min() >= 0 and u.max() < 1


def test_layout_resizes_never_lose_or_repeat_positions():
    rng = np.random.default_rng(0)
    layout = Layout()
    taken_positions: list[int] = []
    emitted: dict[int, list[tuple[int, int]]] = {}  # base position -> token ranges (docs of 10 tokens)
    V = 4
    for phase in range(6):
        counts = rng.integers(0, 12, size=V)
        offsets = {}
        final_taken = []
        for v in range(V):
            pos, offs = layout.share(v, V, 0, int(counts[v]))
            for i, (p, o) in enumerate(zip(pos.tolist(), offs.tolist())):
                last = i == len(pos) - 1
                # The last document of some consumers is left half done.
                end = 10 if not (last and rng.random() < 0.5) else int(rng.integers(o, 10))
                emitted.setdefault(p, []).append((o, end))
                if end < 10 and last:
                    if end > 0:
                        offsets[i * V + v] = end
                    final_taken.append(i)
                    break
            else:
                final_taken.append(int(counts[v]))
        layout.push(V, final_taken, offsets)
        V = int(rng.integers(1, 6))
    assert len(layout.layers) <= 6
    # Drain: every consumer of the last geometry reads a long stretch.
    for v in range(V):
        pos, offs = layout.share(v, V, 0, 60)
        for p, o in zip(pos.tolist(), offs.tolist()):
            emitted.setdefault(p, []).append((o, 10))
    covered = sorted(emitted)
    for p, ranges in emitted.items():
        ranges.sort()
        assert ranges[0][0] == 0, f"position {p} skipped its first tokens: {ranges}"
        for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
            assert b0 == a1, f"position {p} tokens repeated or skipped: {ranges}"
    # No position below the drained frontier was skipped.
    frontier = min(60 * V, len(covered))
    assert covered[:frontier] == list(range(frontier))


def test_layout_state_round_trip_and_folding():
    layout = Layout()
    layout.push(2, [3, 5], {6: 4})
    again = Layout.from_state(layout.to_state())
    assert np.array_equal(again.share(0, 3, 0, 10)[0], layout.share(0, 3, 0, 10)[0])
    # After the new consumers passed the explicit part, the next resize folds it away.
    layout.push(3, [20, 20, 20], {})
    assert len(layout.layers) == 1
