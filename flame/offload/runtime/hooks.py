"""The model hooks of an OffloadEngine: they drive the schedule, the gradients and the
activation arenas from the model's forward and backward.

ModelHooks owns the hook handles, the checkpoint wrappers of recomputed blocks and the per-step
hook state (the offloaded block whose forward runs, whether the backward has started), and the
saved-tensor pack/unpack: saved tensors that are slot weights are stored as (unit, offset, shape,
stride) and re-materialized from the unit's current slot in the backward; an offloaded block's
other floating-point saved tensors go to its host arena.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from flame.offload.runtime.activations import HostActivations
from flame.offload.runtime.gradients import Gradients
from flame.offload.runtime.schedule import WeightSchedule
from flame.offload.runtime.selective import selective_checkpoint
from flame.offload.runtime.streams import PinnedBuffers
from flame.offload.runtime.units import Unit


def _no_cache(kwargs: dict) -> dict:
    """A checkpointed block's keyword arguments without a KV cache: its forward runs again in the
    backward and would append to the cache twice (HF models pass one when `use_cache` is on, as
    `past_key_values`, or `cache` since transformers 5.24; training never reads it). Selective
    recompute refuses the second forward's different ops."""
    out = dict(kwargs)
    for key in ("past_key_values", "cache"):
        if out.get(key) is not None:
            out[key] = None
    if out.get("use_cache"):
        out["use_cache"] = False
    return out


def _input_saving_checkpoint(fn, *args, **kwargs):
    """fn(*args, **kwargs) recomputed in the backward, its tensor arguments saved for it as autograd
    saved tensors (torch's reentrant checkpoint saves its tensor inputs; the non-reentrant one
    keeps them by reference), so that the block's host arena takes the floating-point ones
    (activation mode recompute_host). Every tensor, keyword or not, is a checkpoint input, so that
    grads reach each one; other keyword values (rotary tables in tuples, flags) stay referenced. A
    block whose inputs take no grads (a frozen embedding below) gets its hidden states as a leaf
    that takes one, or its own parameters would get none."""
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    inputs = list(args) + [kwargs[k] for k in keys]
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        i = 0 if args else len(args) + keys.index("hidden_states")
        inputs[i] = inputs[i].detach().requires_grad_(True)

    # the recompute closes over no tensor argument: the checkpoint keeps its function until the
    # backward, and a reference there would keep the input on the GPU beside its host copy
    n = len(args)
    others = {k: v for k, v in kwargs.items() if k not in keys}

    def run(*ts):
        return fn(*ts[:n], **others, **dict(zip(keys, ts[n:])))

    return checkpoint(run, *inputs, use_reentrant=True)


def _checkpointed_module(block: nn.Module, mode: str) -> nn.Module:
    """The module whose forward a checkpoint wraps. A selectively recomputed block compiled on its
    own (`--training.compile`) gets the checkpoint inside the compiled graph, the order torch
    supports: around compiled code, the selective policy's dispatch mode receives the graph's
    random-state operators (SDPA's) and refuses them."""
    orig = getattr(block, "_orig_mod", None)  # torch.compile's OptimizedModule
    return orig if mode == "selective" and isinstance(orig, nn.Module) else block


class ModelHooks:
    def __init__(self, model: nn.Module, blocks: list[nn.Module], units: list[Unit], schedule: WeightSchedule,
                 gradients: Gradients, pinned: PinnedBuffers, device: torch.device):
        """Installs the hooks on `model` (units[i + 1] is blocks[i]); remove() takes them off."""
        self.model, self.blocks, self.units = model, blocks, units
        self.schedule, self.gradients, self.pinned, self.device = schedule, gradients, pinned, device
        self._offloading: HostActivations | None = None  # the offloaded block whose forward runs now
        # the forward's last offloaded block: its GPU copies are dropped once the next one ends or the forward does
        self._last_offloaded: HostActivations | None = None
        # storages of weights that are not slots: never offloaded as activations
        self.weight_storages = {u.weights.resident.untyped_storage().data_ptr()
                                for u in units if u.weights.resident is not None}
        self._bwd_started = False
        self._install()

    def _install(self) -> None:
        """Hooks on the model; their handles are kept so that remove() gives the model back."""
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        h = [self.model.register_forward_pre_hook(self._model_pre), self.model.register_forward_hook(self._model_post)]
        self._wrapped = []
        for i, b in enumerate(self.blocks):
            u = self.units[i + 1]
            h += [b.register_forward_pre_hook(self._block_pre(u)), b.register_forward_hook(self._block_post(u))]
            ckpt = {"recompute": partial(checkpoint, use_reentrant=False), "recompute_host": _input_saving_checkpoint,
                    "selective": selective_checkpoint}.get(u.activation_mode)
            if ckpt is not None:
                inner = _checkpointed_module(b, u.activation_mode)
                inner.forward = lambda *a, _f=inner.forward, _c=ckpt, **k: _c(_f, *a, **_no_cache(k))
                self._wrapped.append(inner)
        for u in self.units:
            for k, (_, p) in enumerate([] if u.frozen else u.params):
                arrived = self._weak_unit_call(partial(ModelHooks._grad_arrived, k=k), u)
                h.append(p.register_post_accumulate_grad_hook(arrived))
        self._handles = h

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        for b in self._wrapped:
            del b.forward  # the instance attribute set above; the class's forward shows again
        self._handles, self._wrapped = [], []

    def _model_pre(self, mod, args):
        self.pinned.join()
        self.schedule.forward_start()
        self.gradients.forward_start()
        self._bwd_started = False
        self._saved_hooks.__enter__()

    def _model_post(self, mod, args, out):
        self._saved_hooks.__exit__(None, None, None)
        if self._last_offloaded is not None:
            self._last_offloaded.release_forward()
            self._last_offloaded = None

    def _block_pre(self, u: Unit):
        def hook(mod, args):
            self.schedule.block_forward(u)
            if u.activations is not None:
                u.activations.begin_forward()
                self._offloading = u.activations

        return hook

    def _block_post(self, u: Unit):
        def hook(mod, args, out):
            self.schedule.release(u)
            if u.activations is not None:
                self._offloading = None
                u.activations.copy_out()
                if self._last_offloaded is not None:  # at most two offloaded blocks on the GPU
                    self._last_offloaded.release_forward()
                self._last_offloaded = u.activations
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._weak_unit_call(ModelHooks._bwd_start, u))

        return hook

    def _bwd_start(self, u: Unit) -> None:
        if not self._bwd_started:
            self._bwd_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        for v in self.units[u.index + 1:]:  # their backward is done
            if v.activations is not None:
                v.activations.release_backward()
        if u.index < len(self.blocks) and self.units[u.index + 1].frozen:
            # the block above has no grads to wait for: its backward (the last read of its
            # weights) ended with this block's output grad
            self._grads_ready(self.units[u.index + 1])
        self.schedule.block_backward(u)
        if u.mode == "stream" and not u.frozen:
            self.gradients.lend_slot(u)

    def _weak_unit_call(self, fn, u: Unit):
        """A hook calling fn(hooks, u) while these hooks live, for hooks that autograd's C++ side
        owns (parameters, graph nodes). The garbage collector cannot see through those: a strong
        reference to the hooks (which reach the engine's parts) or to `u` (which holds the
        parameters) would make a cycle it never collects, keeping the engine, the model and all
        their GPU memory alive after the engine is dropped (a later run in the same process then
        starts that much fuller). Returns None (a tensor hook that leaves the gradient as it is)."""
        me, index = weakref.ref(self), u.index

        def hook(*_):
            hooks = me()
            if hooks is not None:
                fn(hooks, hooks.units[index])

        return hook

    def _grad_arrived(self, u: Unit, k: int) -> None:
        if self.gradients.arrived(u, k):
            self._grads_ready(u)

    def _bwd_end(self) -> None:
        for u in self.units:
            if u.activations is not None:
                u.activations.release_backward()
        for u in self.units:
            if not u.grads.flushed:
                self._grads_ready(u)
        self.gradients.end_round()

    def _grads_ready(self, u: Unit) -> None:
        """All of `u`'s grads of this micro-batch are in its grad buffer."""
        if u.grads.flushed:
            return
        if u.mode == "stream":
            self.schedule.release(u)
        if u.frozen:
            u.grads.flushed = True
            return
        self.gradients.hand_on(u)

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        slots = self.schedule.slot_of_storage
        if slots and t.device.type == self.device.type:
            slot = slots.get(t.untyped_storage().data_ptr())
            if slot is not None and slot.owner is not None:
                return ("w", slot.owner, t.storage_offset(), tuple(t.shape), t.stride())
        a = self._offloading
        if (a is not None and t.device.type == self.device.type and t.is_floating_point()
                and t.untyped_storage().data_ptr() not in self.weight_storages):
            return a.pack(t)
        return t

    @staticmethod
    def _unpack(x):
        # static: every saved tensor of the graph keeps this hook (from C++, unseen by the garbage
        # collector); the hooks must not be reachable from it (see _weak_unit_call)
        if isinstance(x, tuple):
            if x[0] == "a":
                return x[1].unpack(x[2])
            _, u, off, shape, stride = x
            return torch.as_strided(u.weights.slot.buffer, shape, stride, off)
        return x
