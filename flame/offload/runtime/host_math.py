"""Elementwise and reduction passes over host (CPU) grad buffers, chunk by chunk.

torch's CPU kernels are slow or imprecise on these paths: a mixed-dtype add (fp32 += bf16) is not
vectorized; ``vector_norm`` accumulates squares in float32 (about 1% low over tens of millions of
elements) and is slow; a BLAS ``dot`` per chunk is precise but slow on billions of bf16 elements
(benchmarks/host_adds.py times these on a given host). Converting a cache-sized chunk into an fp32 scratch and using torch's own parallel
``add_``, ``square_`` and ``sum`` (a cascade sum: ~1e-8 relative) is vectorized, and the norm
of an accumulator's last add is taken while its chunk is still in cache (or close to it).
Each op needs the GIL to be dispatched, and the training thread holds it for up to the switch
interval while it runs Python: chunks of 32M elements keep the op count per step low (the engine
also shortens the switch interval): as fast as smaller chunks alone, several times faster next
to a Python thread (benchmarks/host_adds.py measures both).
"""

import torch

from flame.offload.planner.cost_model import HOST_MATH_CHUNK


class HostMath:
    """Owns the one fp32 scratch chunk; use from one thread at a time (the engine's CPU worker)."""

    def __init__(self, chunk: int = HOST_MATH_CHUNK):
        self.chunk = chunk
        self.scratch = None

    def _fp32(self, src: torch.Tensor) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.chunk, dtype=torch.float32)
        out = self.scratch[: src.numel()]
        out.copy_(src)
        return out

    def _sq(self, x: torch.Tensor) -> float:
        return float(self._fp32(x).square_().sum())

    def add_(self, acc: torch.Tensor, staged: torch.Tensor, norm: bool = False) -> float | None:
        """acc += staged (acc fp32 or the same dtype as staged); with `norm`, the sum of squares
        of the result (float64 over the chunks), else None."""
        total = 0.0
        for a in range(0, acc.numel(), self.chunk):
            b = min(acc.numel(), a + self.chunk)
            dst = acc[a:b]
            dst.add_(staged[a:b] if acc.dtype == staged.dtype else self._fp32(staged[a:b]))
            if norm:
                total += self._sq(dst)
        return total if norm else None

    def sq_norm(self, t: torch.Tensor) -> float:
        """Sum of squares of a flat host tensor (float64 over the chunks)."""
        return sum(self._sq(t[a:min(t.numel(), a + self.chunk)]) for a in range(0, t.numel(), self.chunk))
