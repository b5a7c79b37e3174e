"""Activation offload: a block's saved tensors go to pinned host memory in the forward and come
back ahead of its backward (the plan's activation mode "offload").

Per block, the tensors autograd saves during its forward (floating point, on the compute device,
not weights) are collected by the saved-tensor hook and replaced by handles. When the block's
forward ends they are copied D2H into the block's pinned arena on the copy stream; the GPU
tensors are dropped once the compute stream has waited for that copy (the next offloaded block's
end, or the end of the model's forward), so at most two offloaded blocks' activations are on the
GPU in the forward. In the backward the engine prefetches them H2D with the block's weights
(the same depth) into fresh GPU tensors; they are dropped when the next lower block's backward
starts. Copying at the block's end rather than at each save is exact for every model autograd
accepts: a saved tensor modified in place later would fail autograd's version check without
hooks.

A saved tensor that fills its memory span exactly (contiguous, or a permuted view such as the
transposed q/k/v attention saves) is copied as that span and restored with its own strides, so
backward kernels see the layout they saw in the forward (fused attention kernels choose paths by
stride); any other (a slice, an expanded view) is copied compactly and restored contiguous. The arena
is one exact-size host buffer per block, page-locked in pieces (streams.register_pinned) the
first time the block runs and again only if a later micro-batch saves more bytes.
"""

from __future__ import annotations

import torch

from flame.offload.runtime.streams import PIN_PIECE_BYTES, Streams, copy_pieces, register_pinned, unregister_pinned

ALIGN = 512  # bytes: every entry's offset in the arena (a dtype view needs its element alignment)


def dense_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s strides when its elements fill exactly numel consecutive elements of its storage from
    its storage offset (some permutation of a contiguous layout), else None."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


class HostActivations:
    """One offloaded block's saved tensors (no reference to the engine: the saved-tensor handles
    hold this object, and autograd's C++ side holds them, see hooks.ModelHooks._weak_unit_call)."""

    def __init__(self, name: str, streams: Streams, device: torch.device, pin: bool,
                 pin_piece_bytes: int = PIN_PIECE_BYTES):
        self.name, self.s, self.device, self.pin = name, streams, device, pin
        self.piece = pin_piece_bytes
        self.arena: torch.Tensor | None = None  # uint8 host buffer
        self.arena_ptrs: list[int] = []
        # per saved tensor: arena offset, bytes, shape, dtype, strides (None: restored contiguous)
        self.entries: list[tuple[int, int, torch.Size, torch.dtype, tuple | None]] = []
        self.keys: dict = {}  # one handle per saved tensor saved twice in one forward
        self.pending: list[torch.Tensor] = []  # this forward's GPU tensors, until copied out
        self.d2h_done = None  # event: the arena holds this micro-batch's tensors
        self.h2d_done = None  # event: the last H2D has read the arena (the next D2H overwrites it)
        self.restored: list[torch.Tensor | None] = []
        self.ready = None  # event: the restored tensors are on the GPU

    @property
    def nbytes(self) -> int:
        return self.entries[-1][0] + self.entries[-1][1] if self.entries else 0

    def begin_forward(self) -> None:
        self.entries, self.keys, self.restored, self.ready = [], {}, [], None

    def pack(self, t: torch.Tensor) -> tuple:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        i = self.keys.get(key)
        if i is None:
            i = self.keys[key] = len(self.entries)
            nb = t.numel() * t.element_size()
            off = -(-self.nbytes // ALIGN) * ALIGN
            self.entries.append((off, nb, t.shape, t.dtype, dense_strides(t)))
            self.pending.append(t)
        return ("a", self, i)

    def copy_out(self) -> None:
        """The block's forward has been issued: copy its saved tensors into the arena (D2H stream)."""
        if not self.pending:
            return
        # the span of a dense tensor as a flat view; a compact copy (on the compute stream) of any other
        src = [torch.as_strided(t, (t.numel(),), (1,), t.storage_offset()) if e[4] is not None
               else t.contiguous().reshape(-1) for t, e in zip(self.pending, self.entries)]
        self.pending = src
        self._fit_arena()
        produced = self.s.record()  # on the compute stream, before switching to the copy stream
        with self.s.on(self.s.d2h):
            self.s.wait(self.s.d2h, produced)
            self.s.wait(self.s.d2h, self.h2d_done)  # the last backward has read the arena
            for (off, nb, *_), t in zip(self.entries, src):
                copy_pieces(self.arena, off, off + nb, t.view(torch.uint8), True, self.piece)
            self.d2h_done = self.s.record(self.s.d2h)

    def release_forward(self) -> None:
        """Drop the GPU copies once the compute stream has waited for their D2H (memory freed in
        stream order: what the compute stream allocates next runs after the copy)."""
        if self.pending:
            self.s.wait(self.s.current(), self.d2h_done)
            self.pending = []

    def _fit_arena(self) -> None:
        need = self.nbytes
        if self.arena is not None and self.arena.numel() >= need:
            return
        if self.h2d_done is not None:
            self.h2d_done.synchronize()  # no copy may still read the arena being replaced
        unregister_pinned(self.arena_ptrs)
        self.arena = torch.empty(need, dtype=torch.uint8)
        self.arena_ptrs = register_pinned(self.arena, self.piece) if self.pin else []

    def fetch(self) -> None:
        """Copy the saved tensors back into fresh GPU tensors on the H2D stream (no host wait)."""
        if self.ready is not None or not self.entries:
            return
        out = [torch.empty(nb, dtype=torch.uint8, device=self.device) for _, nb, *_ in self.entries]
        allocated = self.s.record()  # the compute stream's last use of this memory comes before
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, allocated)
            self.s.wait(self.s.h2d, self.d2h_done)
            for (off, nb, *_), d in zip(self.entries, out):
                copy_pieces(self.arena, off, off + nb, d, False, self.piece)
            self.ready = self.h2d_done = self.s.record(self.s.h2d)
        self.restored = [d.view(dt).view(shape) if st is None else torch.as_strided(d.view(dt), shape, st)
                         for d, (_, _, shape, dt, st) in zip(out, self.entries)]

    def unpack(self, i: int) -> torch.Tensor:
        self.fetch()  # prefetched by the engine; here only when the block's backward came early
        self.s.wait(self.s.current(), self.ready)
        return self.restored[i]

    def release_backward(self) -> None:
        """The block's backward is done: drop the restored tensors (autograd has freed its own)."""
        self.restored, self.ready = [], None

    def close(self) -> None:
        unregister_pinned(self.arena_ptrs)
        self.arena_ptrs, self.arena = [], None
