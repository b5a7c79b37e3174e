"""Registrations that let torchtitan's own trainer (``python -m torchtitan.train``, unpatched) run
the shapes of ``benchmarks/offload.py``; imported by ``--experimental.custom_import
benchmarks.titan_ext`` (torchtitan imports it at the start of ``Trainer.__init__``).

- llama3 flavor ``3B``: Llama 3.2-3B's shape (d 3072, 28 layers, 24 heads, 8 KV heads, FFN 8192,
  vocabulary 128256, untied as every torchtitan llama3). ``8B`` is torchtitan's own flavor.
- dataset ``flame_sample``: flame's bundled corpus (the GPU machine is offline).
- train spec ``llama3_fsdp1``: torchtitan's llama3 spec whose ``parallelize_fn`` runs torchtitan's
  ``parallelize_llama`` and then, on a one-GPU job, torchtitan's ``apply_fsdp`` over a one-rank
  mesh: torchtitan shards only when ``dp_shard > 1``, so without it ``--training.enable_cpu_offload``
  does nothing on one GPU.
- ``FLAME_BENCH_GPU_CAP_GIB``: the GPU cap of flame's ``offload.gpu_memory_gib`` (the same split:
  ``flame.offload.planner.budgets.gpu_budget``), applied with
  ``torch.cuda.set_per_process_memory_fraction``.
"""
from __future__ import annotations

import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "flame", "assets", "sample_corpus")
CAP_ENV = "FLAME_BENCH_GPU_CAP_GIB"

LLAMA_3B = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, rope_theta=500000)


def _load_corpus(path: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=os.path.join(path, "train.jsonl.gz"), split="train")


def _text(sample: dict) -> str:
    return sample["text"]


def parallelize_fsdp_one_gpu(model, parallel_dims, job_config):
    """torchtitan's llama3 parallelization, plus FSDP2 (with ``CPUOffloadPolicy`` under
    ``--training.enable_cpu_offload``) over a one-rank mesh when the job has one GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, parallelize_llama
    from torchtitan.tools.utils import device_type

    model = parallelize_llama(model, parallel_dims, job_config)
    if parallel_dims.fsdp_enabled or parallel_dims.world_size != 1:
        return model
    mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
               reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce], pp_enabled=False,
               cpu_offload=job_config.training.enable_cpu_offload,
               reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward)
    return model


def apply_gpu_cap() -> None:
    """The cap of ``FLAME_BENCH_GPU_CAP_GIB`` on this rank's GPU, split as flame splits it."""
    raw = os.environ.get(CAP_ENV)
    if not raw:
        return
    import torch

    from flame.offload.measure.hardware import outside_allocator_bytes
    from flame.offload.planner.budgets import gpu_budget

    index = int(os.environ.get("LOCAL_RANK", "0"))
    total = torch.cuda.get_device_properties(index).total_memory
    budget = gpu_budget(float(raw), 0.0, total, outside_allocator_bytes(index))
    torch.cuda.set_per_process_memory_fraction(budget.allocator_bytes / total, index)
    print(f"titan_ext: GPU cap {float(raw):.2f} GiB, allocator cap {budget.allocator_bytes / 2**30:.2f} GiB", flush=True)


def register() -> None:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models import llama3
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    llama3.llama3_args.setdefault("3B", TransformerModelArgs(**LLAMA_3B))
    DATASETS.setdefault("flame_sample", DatasetConfig(path=CORPUS, loader=_load_corpus, sample_processor=_text))
    try:
        register_train_spec("llama3_fsdp1", dataclasses.replace(get_train_spec("llama3"),
                                                                parallelize_fn=parallelize_fsdp_one_gpu))
    except ValueError:  # registered already (imported twice)
        pass


register()
apply_gpu_cap()
