"""The random generators' state in the checkpoint, for LoRA dropout (``lora.dropout > 0``).

Dropout draws its masks from the global CPU/CUDA generators; a resumed run restores them so its
masks, and so its losses, continue the uninterrupted run's. Every data-parallel rank is seeded
alike (torchtitan's ``set_determinism``) and draws the same number of numbers per step, so the
state is one value for all ranks: DCP stores it once and loads it everywhere.
"""

import torch
from torch.distributed.checkpoint.stateful import Stateful


class GeneratorState(Stateful):
    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["cpu"])
        if self.device.type == "cuda" and "cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["cuda"], self.device)
