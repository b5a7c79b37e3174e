"""Elementwise and reduction passes over host (CPU) grad buffers, chunked through an fp32 scratch.

torch's CPU kernels are slow or imprecise on these paths, measured on the lent H100 machine's host
(16 cores) and on 2 CPU cores (2026-11-22): a mixed-dtype add (fp32 += bf16) is not vectorized;
``vector_norm`` runs at ~0.2-1.3 G elements/s and, accumulating 67M squares in float32, was 1%
low. Converting a cache-sized chunk into fp32 and using same-dtype ``add_`` / BLAS ``dot`` per
chunk is vectorized, and summing the chunks' dots in float64 keeps the norm within ~1e-5 (a
float32 dot over one chunk of 4M elements).
"""

import torch

CHUNK = 1 << 22  # elements per chunk (16 MiB in fp32: stays in cache between the convert and the use)


class HostMath:
    """Owns the one fp32 scratch chunk; use from one thread at a time (the engine's CPU worker)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self.scratch = None

    def _fp32(self, src: torch.Tensor) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.chunk, dtype=torch.float32)
        out = self.scratch[: src.numel()]
        out.copy_(src)
        return out

    def add_(self, acc: torch.Tensor, staged: torch.Tensor) -> None:
        """acc += staged (acc fp32 or the same dtype as staged)."""
        if acc.dtype == staged.dtype:
            acc.add_(staged)
            return
        for a in range(0, acc.numel(), self.chunk):
            b = min(acc.numel(), a + self.chunk)
            acc[a:b].add_(self._fp32(staged[a:b]))

    def sq_norm(self, t: torch.Tensor) -> float:
        """Sum of squares of a flat host tensor, in float64."""
        total = 0.0
        for a in range(0, t.numel(), self.chunk):
            b = min(t.numel(), a + self.chunk)
            x = t[a:b] if t.dtype == torch.float32 else self._fp32(t[a:b])
            total += float(torch.dot(x, x))
        return total
