"""The IterableDataset run by each DataLoader worker: it plays one consumer and yields batches."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from flame.data.consumer import Consumer, ConversationConsumer
from flame.data.layout import Layout
from flame.data.options import DataOptions
from flame.data.state import fresh
from flame.data.tokenizer import Boundary


class PackedDataset(IterableDataset):
    """Infinite stream of packed batches for one data-parallel rank.

    Worker w of rank r plays consumer ``r * n + (w + rotation) % n`` (n workers). ``rotation``
    makes the worker that yields first after a resume the one whose turn it was, so the batch
    order is exactly that of an uninterrupted run.
    """

    def __init__(self, opts: DataOptions, sources: Sequence[Any], boundary: Boundary, dp_rank: int,
                 dp_world_size: int, with_sources: bool = False, pad_id: int = 0):
        self.opts = opts
        self.sources = list(sources)
        self.boundary = boundary
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.with_sources = with_sources
        self.pad_id = pad_id  # fills the end of SFT rows
        self.n = max(1, opts.num_workers)
        self.start = fresh([s.name for s in sources], [s.streaming for s in sources], dp_world_size, opts.num_workers)
        self.rotation = 0

    def consumer_ids(self) -> list[int]:
        return [self.dp_rank * self.n + w for w in range(self.n)]

    def make_consumer(self, role: int) -> Consumer:
        st = self.start
        v = self.dp_rank * self.n + role
        layouts = [Layout.from_state(x) if x is not None else None for x in st["layouts"]]
        args = (self.sources, layouts, st["streams"], self.opts, self.boundary, v, st["V"], st["gen"],
                st["consumers"].get(str(v)))
        if self.opts.sft:
            return ConversationConsumer(*args, pad_id=self.pad_id)
        return Consumer(*args)

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.n:
            raise RuntimeError(f"dataset built for {self.n} workers runs in {info.num_workers}")
        role = (worker + self.rotation) % self.n
        for batch in self.make_consumer(role).batches_iter(self.with_sources):
            batch["_state"]["w"] = role
            yield batch
