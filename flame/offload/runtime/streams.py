"""Streams and events that are real on CUDA and no-ops on CPU, so the engine runs in CPU tests."""

from __future__ import annotations

import contextlib
import threading

import torch


PIN_PIECE_BYTES = 1 << 30  # cudaHostRegister granularity of the engine's pinned buffers


class _NullEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class Streams:
    """The compute stream (the caller's current stream), an H2D and a D2H copy stream, and the
    copies between pinned host buffers (page-locked in pieces of `pin_piece_bytes`) and the GPU."""

    def __init__(self, device: torch.device, pin_piece_bytes: int = PIN_PIECE_BYTES):
        self.cuda = device.type == "cuda"
        self.pin_piece_bytes = pin_piece_bytes
        self.h2d = self.d2h = None
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)

    def event(self):
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def current(self):
        return torch.cuda.current_stream() if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait(self, stream, event) -> None:
        """`stream` waits for `event` on the device (no host sync)."""
        if self.cuda and event is not None:
            stream.wait_event(event)

    def record(self, stream=None):
        e = self.event()
        if self.cuda:
            e.record(stream or torch.cuda.current_stream())
        return e

    def copy(self, host: torch.Tensor, lo: int, hi: int, dev: torch.Tensor, to_host: bool,
             non_blocking: bool = True) -> None:
        """host[lo:hi] <-> dev[:hi - lo] in the pieces `host` was page-locked in."""
        copy_pieces(host, lo, hi, dev, to_host, self.pin_piece_bytes, non_blocking)


def piece_ranges(lo: int, hi: int, piece: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at every multiple of `piece`: element ranges of a buffer registered in pieces
    of `piece` elements, none of which crosses from one piece into the next."""
    out = []
    while lo < hi:
        end = min(hi, (lo // piece + 1) * piece)
        out.append((lo, end))
        lo = end
    return out


def copy_pieces(host: torch.Tensor, lo: int, hi: int, dev: torch.Tensor, to_host: bool, piece_bytes: int,
                non_blocking: bool = True) -> None:
    """host[lo:hi] <-> dev[:hi - lo] (flat tensors of one dtype), one copy per registered piece of
    `host` (see register_pinned): CUDA rejects an async copy that spans two separately page-locked
    ranges (invalid argument). Every copy that touches a pinned host buffer goes through here."""
    piece = piece_bytes // host.element_size()
    for a, b in piece_ranges(lo, hi, piece):
        h, d = host[a:b], dev[a - lo:b - lo]
        if to_host:
            h.copy_(d, non_blocking=non_blocking)
        else:
            d.copy_(h, non_blocking=non_blocking)


def register_pinned(t: torch.Tensor, piece_bytes: int = PIN_PIECE_BYTES) -> list[int]:
    """Page-lock `t`'s exact bytes with cudaHostRegister in pieces of `piece_bytes` from its first
    byte (no power-of-two rounding of torch's caching host allocator). Returns the registered
    pointers (for unregister). A single async copy must not span two pieces (CUDA rejects it
    with invalid argument): split copies with `piece_ranges`."""
    if not torch.cuda.is_available():
        return []
    rt = torch.cuda.cudart()
    base, total = t.data_ptr(), t.numel() * t.element_size()
    ptrs = []
    for off in range(0, total, piece_bytes):
        n = min(piece_bytes, total - off)
        err = rt.cudaHostRegister(base + off, n, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {n} bytes failed ({err})")
        ptrs.append(base + off)
    return ptrs


def unregister_pinned(ptrs: list[int]) -> None:
    if ptrs and torch.cuda.is_available():
        rt = torch.cuda.cudart()
        for p in ptrs:
            rt.cudaHostUnregister(p)


class PinnedBuffers:
    """Host buffers page-locked on a background thread (while the GPU side is set up); `join`
    before any copy touches them, `release` to unpin."""

    def __init__(self, piece_bytes: int = PIN_PIECE_BYTES):
        self.piece_bytes = piece_bytes
        self.ptrs: list[int] = []
        self.thread: threading.Thread | None = None

    def register_in_background(self, tensors: list[torch.Tensor]) -> None:
        def pin_all():
            for t in tensors:
                self.ptrs += register_pinned(t, self.piece_bytes)

        self.thread = threading.Thread(target=pin_all, daemon=True)
        self.thread.start()

    def join(self) -> None:
        """Wait for the background page-locking: no copy may touch a range being registered."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def release(self) -> None:
        unregister_pinned(self.ptrs)
        self.ptrs = []
