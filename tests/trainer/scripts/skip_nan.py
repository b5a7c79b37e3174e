"""Single-process run where micro-batch 2's loss is poisoned: the step is skipped, counted,
the parameters stay untouched and the LR schedule does not advance."""

import sys

import torch

from flame.config.manager import FlameConfigManager
from flame.train import Trainer

cfg = FlameConfigManager().parse_args(sys.argv[1:])
trainer = Trainer(cfg)
orig = trainer.forward_loss_sum
snap = {}


def poisoned(batch):
    loss = orig(batch)
    if trainer.step == 2:
        snap.update({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
        snap["lr_epoch"] = trainer.lr_schedulers.schedulers[0].last_epoch
        return loss * float("nan")
    if trainer.step == 3:
        for k, v in trainer.model.state_dict().items():
            assert torch.equal(v, snap[k]), f"{k} changed during the skipped step"
        assert trainer.lr_schedulers.schedulers[0].last_epoch == snap["lr_epoch"], "schedule advanced"
        print("skipped step left parameters and schedule untouched", flush=True)
    return loss


trainer.forward_loss_sum = poisoned
trainer.train()
assert trainer.skipped_steps == 1, trainer.skipped_steps
print(f"skipped_steps={trainer.skipped_steps}", flush=True)
trainer.close()
torch.distributed.destroy_process_group()
