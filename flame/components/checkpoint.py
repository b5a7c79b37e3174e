"""torchtitan's CheckpointManager, allowing ``keep_latest_k = 1`` for synchronous saves.

torchtitan refuses k = 1 because an asynchronous save may still be writing the newest
checkpoint while the older one is purged. With synchronous saves the purge runs only after
the new checkpoint is complete (DCP writes ``.metadata`` last and only folders with it are
loaded), so keeping one checkpoint is safe; async modes still require k >= 2.
"""

import dataclasses
import os

from torchtitan.components.checkpoint import CheckpointManager

from flame.errors import ConfigError


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

    def save(self, curr_step: int, last_step: bool = False) -> None:
        super().save(curr_step, last_step)
        # torchtitan purges old checkpoints after interval saves only; the final save counts too
        if last_step and self.enable and self.async_mode == "disabled":
            if os.path.isfile(os.path.join(self._create_checkpoint_id(curr_step), ".metadata")):
                self._purge_stale_checkpoints()
