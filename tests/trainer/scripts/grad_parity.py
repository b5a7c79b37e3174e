"""Run under torchrun (gloo, 2 ranks): gradients of FSDP2 / DDP equal a single-process reference.

Each rank feeds its own half of a global batch with the trainer's loss normalization; the
full gradients gathered from the parallel model must equal those of one process on the whole batch.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flame.components.loss import IGNORE_INDEX, cross_entropy_sum
from flame.distributed.device import init_process_group, local_device
from flame.distributed.parallelize import parallelize
from flame.config.manager import FlameConfigManager
from flame.models import build
from flame.train import Trainer, _parallel_dims, all_sum

mode, config = sys.argv[1], sys.argv[2]
args = ["--model.config", config, "--training.mixed_precision_param", "float32", "--offload.enable", "off"]
if mode == "ddp":
    args += ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
cfg = FlameConfigManager().parse_args(args)
device = local_device()
world = init_process_group(cfg.comm, "/tmp")
pd = _parallel_dims(cfg, world)
rank = dist.get_rank()

mc = build.load_model_config(config)
torch.manual_seed(0)
ref = build.build_meta_model(mc)
ref.to_empty(device=device)
build.init_weights(ref, seed=0)
state = {k: v.clone() for k, v in ref.state_dict().items()}

model = build.build_meta_model(build.load_model_config(config))
model, _ = parallelize(model, pd, cfg, device, None)
model.to_empty(device=device)
build.init_weights(model, seed=1)  # also re-creates non-persistent buffers (rotary inv_freq)
if mode == "ddp":
    model.load_state_dict(state)
else:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))

g = torch.Generator().manual_seed(123)
ids = torch.randint(0, mc.vocab_size, (4, 16), generator=g)
labels = torch.randint(0, mc.vocab_size, (4, 16), generator=g)
labels[0, :5] = IGNORE_INDEX  # uneven valid tokens across ranks
labels[3, 2:] = IGNORE_INDEX

# reference: one process, whole batch
loss = cross_entropy_sum(ref(input_ids=ids).logits, labels) / (labels != IGNORE_INDEX).sum()
loss.backward()

mine = slice(2 * rank, 2 * rank + 2)
local_tokens = (labels[mine] != IGNORE_INDEX).sum().float()
global_tokens = all_sum(local_tokens, pd.get_optional_mesh("batch"))
scale = pd.dp_replicate if (pd.dp_replicate_enabled and not pd.fsdp_enabled) else 1
(cross_entropy_sum(model(input_ids=ids[mine]).logits, labels[mine]) / global_tokens * scale).backward()

worst = 0.0
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    err = ((grad - q.grad).norm() / q.grad.norm().clamp(min=1e-12)).item()
    worst = max(worst, err)
print(f"rank {rank} {mode} worst relative grad error {worst:.2e}", flush=True)
assert worst < 1e-5, worst
dist.destroy_process_group()
