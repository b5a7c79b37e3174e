"""Run under torchrun (gloo, 2 ranks): Muon on a sharded model (``fsdp``: FSDP2; ``tp``: tensor
parallel) gives the single-device update.

Both models start from the same weights and get the same full gradients (each rank keeps its
slice of them) for two optimizer steps; the gathered parameters and the DCP-flattened optimizer
state (Muon's momentum buffers) must equal those of one device. A per-shard orthogonalization
would not: the script checks that it differs on the first sharded matrix.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from flame.components.muon import MUON_GROUP, hidden_matrices
from flame.components.optimizer import build_optimizers
from flame.config.manager import FlameConfigManager
from flame.distributed.device import init_process_group, local_device
from flame.train import _parallel_dims
from twins import reference_and_parallel

mode, config = sys.argv[1], sys.argv[2]
args = ["--model.config", config, "--training.mixed_precision_param", "float32", "--offload.enable", "off",
        "--optimizer.name", "Muon", "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.1"]
args += {"fsdp": ["--parallelism.data_parallel_shard_degree", "2"],
         "tp": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]}[mode]
cfg = FlameConfigManager().parse_args(args)
device = local_device()
pd = _parallel_dims(cfg, init_process_group(cfg.comm, "/tmp"))
rank = dist.get_rank()

_, ref, model = reference_and_parallel(config, cfg, pd, device)

opt_ref = build_optimizers([ref], cfg.optimizer, device)
opt = build_optimizers([model], cfg.optimizer, device)
n_muon = len(hidden_matrices(model))
assert n_muon == 14, n_muon  # q, k, v, o, gate, up, down of two layers; embeddings and head use AdamW
assert sum(p.numel() for g in opt.optimizers[0].param_groups if g[MUON_GROUP] for p in g["params"]) > 0

sharded = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor) and id(p) in hidden_matrices(model)]
assert sharded, "no sharded hidden matrix"

gen = torch.Generator().manual_seed(1234)
for step in range(2):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        g = torch.randn(q.shape, generator=gen)
        q.grad = g.clone()
        p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g.clone()
    opt_ref.step()
    opt.step()

worst = 0.0
for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
    full = p.full_tensor() if isinstance(p, DTensor) else p
    worst = max(worst, (full - q).abs().max().item())
assert worst <= 1e-6, f"worst parameter difference {worst}"

# the state DCP saves: Muon's momentum buffers under each parameter's name, sharded like it
sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
name = sharded[0][0]
buf = sd[f"state.{name}.momentum_buffer"]
assert isinstance(buf, DTensor) and torch.equal(buf.full_tensor(), sd_ref[f"state.{name}.momentum_buffer"])
assert f"state.model.embed_tokens.weight.exp_avg" in sd

# what per-shard orthogonalization would give instead (the error the whole-matrix gather avoids)
from torch.optim._muon import _zeropower_via_newtonschulz as ns

u = sharded[0][1].grad
args_ns = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
per_shard = ns(u.to_local(), *args_ns).float()
whole = distribute_tensor(ns(u.full_tensor(), *args_ns).float(), u.device_mesh, u.placements, src_data_rank=None)
gap = (per_shard - whole.to_local()).abs().max().item()
assert gap > 1e-2, gap
print(f"rank {rank}: {mode} muon update equals one device (worst {worst:.2e}; per-shard would differ by {gap:.2e})")
dist.destroy_process_group()
