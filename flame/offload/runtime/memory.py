"""What an OffloadEngine holds on its compute device, by the planner's memory categories: the
measured side of cost_model.static_gpu_bytes, read from every part that owns device buffers
(the units' resident copies, grads and GPU optimizer state, the schedule's slots, the gradients'
slots and conversion buffer, the model's own buffers)."""

from __future__ import annotations

import torch
import torch.nn as nn

from flame.offload.planner.cost_model import MEMORY_CATEGORIES
from flame.offload.runtime.gradients import Gradients
from flame.offload.runtime.schedule import WeightSchedule
from flame.offload.runtime.units import Unit


def device_bytes(units: list[Unit], schedule: WeightSchedule, gradients: Gradients, model: nn.Module,
                 device: torch.device) -> dict[str, int]:
    """Bytes on `device` by the categories of cost_model.static_gpu_bytes (each storage counted
    once, under the first category that names it: a master that is the compute copy counts as
    compute, an accumulator that is the grad buffer as grads), plus "other" (the model's buffers,
    optimizer step counters) and "total". Activations and a step's transients are not the
    engine's and not in here; the moments appear after the first step (AdamW allocates them
    lazily)."""
    rep = dict.fromkeys(MEMORY_CATEGORIES + ("other",), 0)
    seen = set()

    def add(cat, t):
        if t is not None and t.device.type == device.type and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            rep[cat] += t.untyped_storage().nbytes()

    for u in units:
        if u.mode != "stream":
            add("compute", u.weights.resident)
            add("grads", u.grads.buffer)
        add("grad_acc", u.grads.device_accumulator)  # host units accumulating on the GPU
        add("shards", u.grads.shard)  # data parallelism: the reduce-scattered grad shard
        if u.mode == "gpu" and not u.frozen:  # host units keep these on the host
            o = u.optimizer
            add("grad_acc", u.grads.accumulator)
            add("master", o.master.data)
            for k, v in o.adamw.state.get(o.master, {}).items():
                add("moments" if k in ("exp_avg", "exp_avg_sq") else "other", v)
    for cat, bufs in (("slots", [x.buffer for x in schedule.slots]),
                      ("grad_slots", [x.buffer for x in gradients.slots]),
                      ("conversion", gradients.conversion),
                      ("other", list(model.buffers()) + [gradients.gpu_sq])):
        for b in bufs:
            add(cat, b)
    rep["total"] = sum(rep.values())
    return rep
