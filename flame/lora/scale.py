"""The adapters' scale in the checkpoint: ``lora.alpha`` (with ``lora.rank``) of the run that trained them.

No tensor stores alpha, yet the model a LoRA checkpoint holds is W + alpha / rank * B @ A. A resume
with another alpha would go on training, and (the relaunch rewrites the dump's job_config.json,
which the exports read) export, another model than the one saved: it is refused at the load.
Checkpoints written before flame saved this state load as before, unchecked.
"""

from torch.distributed.checkpoint.stateful import Stateful

from flame.errors import ConfigError

STATE_KEY = "lora_scale"


class AdapterScale(Stateful):
    def __init__(self, rank: int, alpha: float):
        self.rank, self.alpha = int(rank), float(alpha)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = float(state_dict["alpha"])
        if saved != self.alpha:
            raise ConfigError(f"lora.alpha={self.alpha:g}: the checkpoint's adapters were trained with lora.alpha="
                              f"{saved:g} (resume with it, or train in another job.dump_folder)")
