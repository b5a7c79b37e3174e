"""The dataloader the trainer iterates: torchtitan's ParallelAwareDataloader (a torchdata
StatefulDataLoader) whose checkpoint state is one global position instead of per-rank pickles."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import sys
import warnings
from typing import Any, Iterator

import torch.distributed as dist
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from flame.data import state as gstate
from flame.data.dataset import PackedDataset

STATE_KEY = "flame_data_position"
LOG_EVERY = 1000  # batches between per-source token count log lines


def workers_from_a_fork_server(loaders) -> None:
    """The loaders' workers forked from a fork server (a fresh process) instead of from the
    trainer, so that they share none of its pages: a trainer holding its model state in host
    memory would see every page they share copied once it rewrites it.

    The server imports the trainer's module and the datasets library once, before it forks, and
    is started now, so that those imports run beside the rest of the trainer's setup. Without the
    preload every worker imported flame (torch, FLA) itself before its first batch: multiprocessing
    preloads a main module only when it was run as a file, and the trainer runs as a module.
    Calling this again is harmless (the server starts once)."""
    loaders = [loader for loader in loaders if loader is not None and loader.num_workers > 0]
    if not loaders:
        return
    context = multiprocessing.get_context("forkserver")
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    # a package's __main__ is not imported (it may run its program unguarded), as spawn does
    name = main.name if main is not None and main.name.rpartition(".")[2] != "__main__" else "__main__"
    context.set_forkserver_preload([name, "datasets"])
    for loader in loaders:
        loader.multiprocessing_context = context
    multiprocessing.forkserver.ensure_running()


class FlameDataLoader(ParallelAwareDataloader):
    """Iterable forever; ``state_dict()``/``load_state_dict()`` carry the global data position.

    ``state_dict()`` gathers every rank's consumer counters when torch.distributed is initialized
    (it must then be called on all ranks together, as DCP's save does), so all ranks return the same
    value. Without a process group it returns this rank's part; :func:`flame.data.state.merge` of
    all parts is what a distributed run would save (used by tests and tools).
    """

    def __init__(self, dataset: PackedDataset, dp_rank: int, dp_world_size: int, **kwargs: Any):
        with warnings.catch_warnings():
            # torchdata's own call of a deprecated torch function, on every run; nothing to act on
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(dataset, dp_rank, dp_world_size, batch_size=None, **kwargs)
        self.packed = dataset
        self._consumers: dict[str, dict] = {}
        self._next_worker = 0
        self._served = 0
        self.track_state = True
        self.last_consumer = -1

    # -- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        inner = super().__iter__()
        for batch in inner:
            st = batch.pop("_state")
            self.last_consumer = int(st["v"])  # which consumer made this batch (tests, debugging)
            if self.track_state:
                self._consumers[str(st["v"])] = st
                self._next_worker = (int(st["w"]) + 1) % self.packed.n
            self._served += 1
            if self._served % LOG_EVERY == 0:
                self._log_tokens(self._local_view())
            yield batch

    # -- state --------------------------------------------------------------------------------------
    def _local_view(self) -> dict:
        base = self.packed.start
        view = {k: v for k, v in base.items() if k not in ("consumers", "next_worker")}
        consumers = {str(v): base["consumers"][str(v)] for v in self.packed.consumer_ids()
                     if str(v) in base["consumers"]}
        consumers.update(self._consumers)
        view["consumers"] = consumers
        # Role of the worker whose batch comes next (workers take turns in role order).
        view["next_worker"] = {str(self.dp_rank): self._next_worker if self._served else self.packed.rotation}
        return view

    def global_state(self) -> dict:
        local = self._local_view()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, local)
            return gstate.merge(parts)
        return local

    def state_dict(self) -> dict[str, Any]:
        g = self.global_state()
        if self.dp_rank == 0:
            self._log_tokens(g)
        # A JSON string: one small leaf that DCP stores once and anyone can read.
        return {STATE_KEY: json.dumps(g, separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or STATE_KEY not in state_dict:
            if state_dict:
                logger.warning("dataloader: checkpoint has no flame data position; starting from the beginning")
            return
        raw = state_dict[STATE_KEY]
        g = json.loads(raw if isinstance(raw, str) else bytes(raw).decode())
        self.load_global_state(g)

    def load_global_state(self, g: dict) -> None:
        gstate.check_compatible(g, [s.name for s in self.packed.sources])
        old = (g["dp_world_size"], g["num_workers"])
        g, exact = gstate.reshard(g, self.dp_world_size, self.packed.opts.num_workers)
        if not exact:
            # the position counts readers per rank: the loader workers, or the main process without any
            logger.info(f"dataloader: resuming a position saved with dp_world_size={old[0]} and {old[1]} "
                        f"reader(s) per rank on dp_world_size={self.dp_world_size} and "
                        f"{max(1, self.packed.opts.num_workers)} (elastic resume)")
        self.packed.start = g
        self.packed.rotation = int(g["next_worker"].get(str(self.dp_rank), 0)) if exact else 0
        self._consumers = {}
        self._next_worker = 0
        self._served = 0
        # Workers copy the dataset when an iterator starts: drop any persistent one.
        self._iterator = None

    def source_token_counts(self) -> dict[str, int]:
        """Tokens taken from each source so far (this rank's consumers, plus earlier runs)."""
        return gstate.summary(self._local_view())["tokens"]

    def bad_document_counts(self) -> dict[str, int]:
        """Bad rows (not valid UTF-8; skipped or replaced) met per source so far (as above)."""
        return self._bad_counts(self._local_view())

    def _bad_counts(self, state: dict) -> dict[str, int]:
        # plus those found when the sources were opened (.txt files): every run finds them again, so
        # they are not in the saved state
        opened = [s.bad_rows.found_at_open if s.bad_rows is not None else 0 for s in self.packed.sources]
        return dict(zip(state["sources"], (a + b for a, b in zip(gstate.bad_totals(state), opened))))

    def _log_tokens(self, g: dict) -> None:
        summary = gstate.summary(g)
        counts = summary["tokens"]
        if not any(counts.values()):
            return  # nothing read yet (e.g. the template DCP asks for before loading)
        line = "dataloader tokens per source: " + ", ".join(f"{k}={v:,}" for k, v in counts.items())
        bad = {k: v for k, v in self._bad_counts(g).items() if v}
        if bad:
            policy = self.packed.opts.bad_document_policy
            line += f"; bad rows ({policy}): " + ", ".join(f"{k}={v:,}" for k, v in bad.items())
        logger.info(line)
