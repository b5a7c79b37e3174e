"""torchtitan's CheckpointManager with complete-or-nothing step folders.

A step folder counts only when it is complete: rank 0 writes ``.flame_complete.json`` last, after
every rank's files and DCP's ``.metadata`` are on disk, with the size and CRC-32 of each file (each
rank checksums its own ``__RANK_*.distcp`` files, rank 0 merges them). A save begins by removing a
stale record and leaving ``.flame_saving`` in the folder, so a folder killed mid-write is told
apart from one written before flame recorded checksums (``legacy``: ``.metadata`` and neither file;
it loads with a warning, after a structural check of ``.metadata`` against the file sizes).

Resuming (``checkpoint.load_step -1``) takes the newest complete checkpoint whose files match their
record. Newer incomplete folders are named in one log line; a damaged one (size or checksum
mismatch, missing file) is named in one line with the file, then the previous complete one is
loaded, or the run stops (``checkpoint.on_damaged stop``). Step folders of which none is usable stop
the run unless ``checkpoint.allow_fresh_start``. Verification is split over the ranks.

Cleanup (``keep_latest_k``) counts complete checkpoints only: it keeps the newest k of them,
deletes older complete ones and incomplete folders older than the newest complete one (they can
never be loaded), and leaves newer incomplete folders alone (an async save in progress, or a
killed save that the run overwrites when it reaches that step again).

``keep_latest_k = 1`` is allowed for synchronous saves (torchtitan refuses it because an async save
may still be writing the newest checkpoint while the older one is purged); async modes keep >= 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from flame.errors import ConfigError
from flame.lora.scale import STATE_KEY as LORA_SCALE

COMPLETE = ".flame_complete.json"
SAVING = ".flame_saving"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_CHUNK = 8 << 20


# -- files on disk (no collectives) ---------------------------------------------------------
def file_record(path: str) -> dict:
    """Size and CRC-32 of one file (CRC-32 catches every flipped bit within a chunk)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def _checkpoint_files(folder: str) -> list[str]:
    """The files a record covers: everything in the folder but flame's own markers and temporaries."""
    return sorted(n for n in os.listdir(folder) if n not in (COMPLETE, SAVING) and not n.endswith(".tmp")
                  and os.path.isfile(os.path.join(folder, n)))


def write_record(folder: str, files: dict, world_size: int = 1) -> None:
    """Write the completion record (last, atomically) and drop the in-progress marker."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
    tmp = os.path.join(folder, COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "step": int(m.group(1)) if m else None, "world_size": world_size,
                   "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, COMPLETE))
    if os.path.exists(os.path.join(folder, SAVING)):
        os.remove(os.path.join(folder, SAVING))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename reaches the disk before anything relies on it
    finally:
        os.close(fd)


def record_folder(folder: str) -> None:
    """Record a checkpoint written by one process (``convert_hf_to_dcp``) as complete."""
    write_record(folder, {n: file_record(os.path.join(folder, n)) for n in _checkpoint_files(folder)})


def check_file(folder: str, name: str, want: dict) -> str | None:
    """A one-line problem with ``folder/name`` against its record, or None."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != want["size"]:
        return f"{path} has {size} bytes, {want['size']} were written"
    if file_record(path)["crc32"] != want["crc32"]:
        return f"{path} does not match its checksum (changed on disk since it was written)"
    return None


def check_legacy(folder: str) -> str | None:
    """Structural check of a folder without a completion record: ``.metadata`` unpickles (this runs
    pickle: load only your own checkpoints) and every file it names holds the byte ranges it names."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged checkpoint
        return f"{os.path.join(folder, '.metadata')} is unreadable ({type(e).__name__})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        if os.path.getsize(path) < end:
            return f"{path} has {os.path.getsize(path)} bytes, .metadata needs {end}"
    return None


@dataclasses.dataclass
class StepFolder:
    step: int
    path: str
    kind: str  # "complete" | "legacy" | "incomplete" (| "damaged", found so at load)
    record: dict | None = None
    reason: str = ""


def classify(path: str, step: int = -1) -> StepFolder:
    """One step folder as complete (record readable), incomplete, or legacy (no flame files, ``.metadata``)."""
    marker = os.path.join(path, COMPLETE)
    if os.path.isfile(marker):
        try:
            with open(marker) as f:
                record = json.load(f)
            files = record["files"]
            if not all(isinstance(v, dict) and {"size", "crc32"} <= v.keys() for v in files.values()):
                raise ValueError("bad file entry")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return StepFolder(step, path, "incomplete", reason=f"{marker} is unreadable")
        return StepFolder(step, path, "complete", record=record)
    if os.path.exists(os.path.join(path, SAVING)):
        return StepFolder(step, path, "incomplete", reason="the save did not finish")
    if os.path.isfile(os.path.join(path, ".metadata")):
        return StepFolder(step, path, "legacy")
    return StepFolder(step, path, "incomplete", reason="no .metadata")


def scan(folder: str) -> dict[int, StepFolder]:
    """The ``step-N`` folders under ``folder`` by step, each classified (only the records are read)."""
    out: dict[int, StepFolder] = {}
    if not os.path.isdir(folder):
        return out
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            out[int(m.group(1))] = classify(os.path.join(folder, name), int(m.group(1)))
    return dict(sorted(out.items()))


def verify(entry: StepFolder, rank: int = 0, world: int = 1) -> str | None:
    """This rank's share of the check of one step folder: the first problem found, or None."""
    if entry.kind == "legacy":
        return check_legacy(entry.path) if rank == 0 else None
    files = sorted(entry.record["files"].items())
    for i, (name, want) in enumerate(files):
        if i % world == rank:
            problem = check_file(entry.path, name, want)
            if problem:
                return problem
    return None


# the non-model states of a checkpoint (the model's tensors are stored under their own names)
_NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state", "lora_rng", LORA_SCALE)


def saved_model_keys(metadata_keys) -> list[str]:
    """The model's tensor names among a DCP checkpoint's keys (everything but the non-model states)."""
    return [k for k in metadata_keys if k.split(".", 1)[0] not in _NON_MODEL_STATES]


def mismatch_message(exc: BaseException) -> str | None:
    """'tensor X is [a, b] in the checkpoint, [c, d] in this model' from DCP's load errors."""
    texts = [str(exc)]
    if isinstance(exc, CheckpointException):
        texts = [str(e) for e, _ in exc.failures.values()] + texts
    for text in texts:
        m = re.search(r"Size mismatch between saved torch\.Size\((\[.*?\])\) and current: "
                      r"torch\.Size\((\[.*?\])\) for (\S+)", text)
        if m:
            return f"tensor {m.group(3)} is {m.group(1)} in the checkpoint, {m.group(2)} in this model"
        m = re.search(r"Missing key in checkpoint state_dict: (\S+?)\.?$", text, re.M)
        if m and m.group(1).split(".")[0] in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
            return (f"it holds no {m.group(1).split('.')[0]} state (a model-only checkpoint, e.g. a last step saved "
                    "with checkpoint.last_save_model_only)")
        if m:
            return f"tensor {m.group(1)} of this model is not in the checkpoint"
    return None


def saved_keys(checkpoint_id: str) -> dict:
    """The DCP checkpoint's keys (with their metadata), read from its ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata


def _saved_keys_or_none(checkpoint_id: str) -> dict:
    try:
        return saved_keys(checkpoint_id)
    except Exception:  # an unreadable checkpoint: the error at hand says more
        return {}


def holds_optimizer_state(checkpoint_id: str) -> bool:
    """The DCP checkpoint has optimizer state (of whichever optimizer saved it)."""
    return any(key.startswith("optimizer.state.") for key in _saved_keys_or_none(checkpoint_id))


def names_with_wrapper_parts(checkpoint_id: str) -> bool:
    """The DCP checkpoint's tensor names hold wrapper parts (``_orig_mod``, ...), as the offload
    engine's did before it saved plain names."""
    from flame.models.blocks import WRAPPER_PARTS

    return any(part in WRAPPER_PARTS for key in _saved_keys_or_none(checkpoint_id) for part in key.split("."))


# -- the manager ----------------------------------------------------------------------------
class FlameCheckpointManager(CheckpointManager):
    def __init__(self, *args, checkpoint_config, **kwargs):
        keep = checkpoint_config.keep_latest_k
        if keep == 1:
            if checkpoint_config.async_mode != "disabled":
                raise ConfigError(
                    f"checkpoint.keep_latest_k 1 with checkpoint.async_mode {checkpoint_config.async_mode!r}: "
                    "an async save may still be writing the newest checkpoint; keep at least 2"
                )
            checkpoint_config = dataclasses.replace(checkpoint_config, keep_latest_k=2)
        super().__init__(*args, checkpoint_config=checkpoint_config, **kwargs)
        if keep == 1:
            self.keep_latest_k = 1
        self.on_damaged = getattr(checkpoint_config, "on_damaged", "fallback")
        self.allow_fresh_start = getattr(checkpoint_config, "allow_fresh_start", False)
        self._pending = None  # (checkpoint_id, future) of an async save without its record yet
        # checksums and verdicts travel over gloo (plain Python objects, any device)
        self._group = dist.new_group(backend="gloo") if self.enable and dist.is_initialized() else None

    # -- collectives ----------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        if self._group is None:
            return 0, 1
        return dist.get_rank(), dist.get_world_size()

    def _gather(self, obj) -> list:
        if self._group is None:
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # -- saving ---------------------------------------------------------------------------
    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        rank, _ = self._rank_world()
        if rank == 0:
            # ranks other than 0 write nothing before DCP's first collective, which rank 0 reaches after this
            os.makedirs(checkpoint_id, exist_ok=True)
            if os.path.exists(os.path.join(checkpoint_id, COMPLETE)):
                os.remove(os.path.join(checkpoint_id, COMPLETE))  # the folder is rewritten: not complete until recorded
            open(os.path.join(checkpoint_id, SAVING), "w").close()
        ret = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.DISABLED:
            self._record_complete(checkpoint_id)
        else:
            self._pending = (checkpoint_id, getattr(ret, "upload_completion", ret))
        return ret

    def _record_complete(self, checkpoint_id: str) -> None:
        """Collective: each rank checksums its own files, rank 0 writes the record last."""
        rank, world = self._rank_world()
        mine = {}
        for name in _checkpoint_files(checkpoint_id):
            m = _RANK_FILE.match(name)
            owner = int(m.group(1)) if m and int(m.group(1)) < world else 0
            if owner == rank:
                mine[name] = file_record(os.path.join(checkpoint_id, name))
        files = {k: v for part in self._gather(mine) for k, v in part.items()}
        if rank == 0:
            write_record(checkpoint_id, files, world)

    def _finish_pending(self) -> None:
        checkpoint_id, future = self._pending
        self._pending = None
        future.result()  # a failed background save raises here, as in torchtitan
        self._record_complete(checkpoint_id)

    def _async_wait(self) -> None:
        super()._async_wait()
        if self._pending is not None:
            self._finish_pending()

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if self._pending is not None and not last_step:
            # record an async checkpoint at the first step at which every rank's write is done
            done = torch.tensor([int(self._pending[1].done())])
            if self._group is not None:
                dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._group)
            if done.item():
                self._finish_pending()
        super().save(curr_step, last_step)
        # torchtitan purges old checkpoints after interval saves only; the final (synchronous) save counts too
        if last_step and self.enable:
            if os.path.isfile(os.path.join(self._create_checkpoint_id(curr_step), COMPLETE)):
                self._purge_stale_checkpoints()

    def close(self):
        if getattr(self, "_pending", None) is not None and dist.is_initialized():
            try:
                self._finish_pending()
            except Exception as e:  # noqa: BLE001 - the checkpoint stays incomplete and is skipped at load
                logger.warning(f"checkpoint: the background save did not finish ({type(e).__name__}: {e})")
        super().close()

    def _purge_stale_checkpoints(self):
        if self.keep_latest_k <= 0 or self._rank_world()[0] != 0:
            return
        entries = sorted(scan(self.folder).values(), key=lambda e: e.step, reverse=True)
        usable = [e for e in entries if e.kind != "incomplete"]
        keep = {e.step for e in usable[: self.keep_latest_k]}
        newest = usable[0].step if usable else None
        for e in entries:
            if e.step in keep:
                continue
            if e.kind != "incomplete" or (newest is not None and e.step < newest):
                self.purge_queue.put(e.path)

    # -- loading --------------------------------------------------------------------------
    def _warn(self, message: str) -> None:
        """Every rank reaches the same verdict; rank 0 says it (one line on the console, not one per rank)."""
        if self._rank_world()[0] == 0:
            logger.warning(message)

    def _verify(self, entry: StepFolder) -> str | None:
        rank, world = self._rank_world()
        problems = [p for p in self._gather(verify(entry, rank, world)) if p]
        return min(problems) if problems else None

    @torch.no_grad()
    def load(self, step: int = -1) -> bool:
        if self.enable_ft_dataloader_checkpoints:
            self._ft_load()
        if not self.enable:
            return False
        entries = scan(self.folder)
        if not entries:
            if step != -1 and not self.initial_load_path:
                raise ConfigError(f"checkpoint.load_step {step}: there are no checkpoints in {self.folder!r}")
            if self.initial_load_path and not os.path.isdir(self.folder):
                self._check_initial_load_path()
            return self._guarded(lambda: super(FlameCheckpointManager, self).load(step), self.initial_load_path)
        available = ", ".join(str(s) for s, e in entries.items() if e.kind != "incomplete") or "none complete"
        if step != -1:
            entry = entries.get(step)
            if entry is None:
                raise ConfigError(f"checkpoint.load_step {step}: no step-{step} in {self.folder!r} "
                                  f"(available steps: {available})")
            if entry.kind == "incomplete":
                raise ConfigError(f"checkpoint.load_step {step}: {entry.path} is incomplete ({entry.reason}); "
                                  f"available steps: {available}")
            problem = self._verify(entry)
            if problem:
                raise ConfigError(f"checkpoint.load_step {step}: damaged checkpoint: {problem}")
            return self._load_entry(entry)

        skipped = []  # newer than the one loaded: incomplete (named in one line here) or damaged (one line each)
        for entry in sorted(entries.values(), key=lambda e: e.step, reverse=True):
            if entry.kind == "incomplete":
                skipped.append(entry)
                continue
            problem = self._verify(entry)
            if problem is None:
                incomplete = [e for e in skipped if e.kind == "incomplete"]
                if incomplete:
                    self._warn("checkpoint: skipping incomplete " + ", ".join(
                        f"step-{e.step} ({e.reason})" for e in incomplete) + f"; resuming from step-{entry.step}")
                return self._load_entry(entry)
            if self.on_damaged == "stop":
                raise ConfigError(f"damaged checkpoint: {problem} (checkpoint.on_damaged stop; use fallback to "
                                  f"load the previous complete checkpoint)")
            self._warn(f"checkpoint: damaged: {problem}; falling back to the previous complete checkpoint")
            skipped.append(dataclasses.replace(entry, kind="damaged", reason=f"damaged: {problem}"))
        summary = ", ".join(f"step-{e.step} ({e.reason})" for e in skipped)
        if all(e.kind == "incomplete" for e in skipped):
            # only saves cut short before any completed: nothing complete was ever written, so starting
            # over loses nothing (refusing would make every relaunch of a run killed in its first save fail)
            self._warn(f"checkpoint: no complete checkpoint in {self.folder} ({summary}); training from step 1")
            return False
        if self.allow_fresh_start:
            self._warn(f"checkpoint: no usable checkpoint in {self.folder} ({summary}); training from step 1 "
                           "(checkpoint.allow_fresh_start)")
            return False
        raise ConfigError(f"no usable checkpoint in {self.folder!r}: {summary}; pass --checkpoint.allow_fresh_start "
                          "to train from step 1 anyway")

    def _check_initial_load_path(self) -> None:
        path = self.initial_load_path
        if not os.path.isdir(path):
            raise ConfigError(f"checkpoint.initial_load_path {path!r}: no such folder")
        if self.initial_load_in_hf:
            return
        entry = classify(path)
        if entry.kind == "incomplete":
            raise ConfigError(f"checkpoint.initial_load_path {path!r}: not a complete DCP checkpoint ({entry.reason})")
        problem = self._verify(entry)
        if problem:
            raise ConfigError(f"checkpoint.initial_load_path {path!r}: damaged checkpoint: {problem}")

    def _load_entry(self, entry: StepFolder) -> bool:
        if entry.kind == "legacy":
            self._warn(f"checkpoint: {entry.path} has no completion record (written before flame recorded "
                           "checksums); loading it unverified")
        logger.info(f"Loading the checkpoint from {entry.path}.")
        states = self._states_to_load(model_only=entry.step == 0)
        self._guarded(lambda: self.dcp_load(states, checkpoint_id=entry.path, from_hf=False, from_quantized=False),
                      entry.path)
        return True

    def _states_to_load(self, model_only: bool):
        self._model_only_load = model_only
        return super()._states_to_load(model_only)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
        saved = None  # the checkpoint's keys, read once: before DCP's load only where needed there
        if getattr(self, "_model_only_load", False) and not from_hf:
            # a model-only checkpoint without LoRA adapters (a base converted with convert_hf_to_dcp,
            # or a pretraining run's): a LoRA run starts its adapters from their init
            from flame.lora import is_adapter_key

            saved = saved_keys(checkpoint_id)
            fresh = [k for k in state_dict if is_adapter_key(k) and k not in saved]
            if fresh:
                self._warn(f"checkpoint: {checkpoint_id} holds no LoRA adapters; {len(fresh)} adapter tensors "
                           "keep their initialization")
                state_dict = {k: v for k, v in state_dict.items() if k not in fresh}
        if not from_hf:
            # DCP loads the keys asked for and ignores the rest: a model with fewer tensors than the
            # checkpoint (fewer layers, no LoRA adapters) would drop some of its weights silently.
            # Checked before the load, whose errors (the optimizer state of other parameters) would
            # name a consequence instead
            from flame.lora import is_adapter_key

            saved = saved if saved is not None else saved_keys(checkpoint_id)
            if LORA_SCALE in state_dict and not any(k.startswith(LORA_SCALE + ".") for k in saved):
                # a LoRA checkpoint written before flame saved alpha: loaded unchecked, as before
                state_dict = {k: v for k, v in state_dict.items() if k != LORA_SCALE}
            extra = [k for k in saved_model_keys(saved) if k not in state_dict]
            if extra:
                hint = ("a LoRA run's adapters: resume with its lora.rank" if is_adapter_key(extra[0])
                        else "resuming with another model config?")
                raise ConfigError(f"checkpoint {checkpoint_id} does not fit this run: tensor {extra[0]} of the "
                                  f"checkpoint is not in this model ({len(extra)} such; {hint})")
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)

    @staticmethod
    def _guarded(fn, where: str):
        """DCP's shape and key errors as one line naming the tensor (resuming with another model config)."""
        try:
            return fn()
        except (CheckpointException, RuntimeError, ValueError) as e:
            detail = mismatch_message(e)
            if detail is None:
                raise
            if detail.startswith("it holds no optimizer") and holds_optimizer_state(where):
                detail, hint = "its optimizer state is another optimizer's", " (resuming with another optimizer.name?)"
            elif detail.startswith("it holds no"):
                hint = ""
            elif names_with_wrapper_parts(where):
                hint = (" (its tensors are named with torch.compile/activation-checkpointing wrapper parts such "
                        "as _orig_mod: an offloaded run of a flame before commit 6bac658 wrote it, and flame now "
                        "saves and loads the plain names; resume it with the flame that wrote it)")
            else:
                hint = " (resuming with another model config?)"
            raise ConfigError(f"checkpoint {where} does not fit this run: {detail}{hint}") from None
