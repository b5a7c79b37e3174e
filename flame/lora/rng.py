"""The random generators' state in the checkpoint, for LoRA dropout (``lora.dropout > 0``).

Dropout draws its masks from the global CPU/CUDA generators; a resumed run restores them so its
masks, and so its losses, continue the uninterrupted run's. The loaded state is put back right
before the model's first forward, not at the load: the data loader draws its seed from the global
generator when the first batch is fetched, which the uninterrupted run did before step 1. Every
data-parallel rank is seeded alike (torchtitan's ``set_determinism``) and draws the same number of
numbers per step, so the state is one value for all ranks: DCP stores it once and loads it everywhere.
"""

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful


class GeneratorState(Stateful):
    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.hook = None

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        if self.hook is not None:
            self.hook.remove()

        def restore(module, args):
            self.hook.remove()
            self.hook = None
            torch.set_rng_state(state_dict["cpu"])
            if self.device.type == "cuda" and "cuda" in state_dict:
                torch.cuda.set_rng_state(state_dict["cuda"], self.device)

        self.hook = self.model.register_forward_pre_hook(restore)
