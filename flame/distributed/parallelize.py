"""Apply TP, activation checkpointing, per-block compile and FSDP2/HSDP/DDP to a meta model.

``prepare_blocks`` (TP, AC, compile) runs for every run; ``apply_data_parallel`` (FSDP2/HSDP/DDP)
only when the host-offload engine does not take the model (``flame.offload.maybe_offload``
decides, between the two). ``parallelize`` is both, for a run without offload.
"""

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import _apply_ac_to_transformer_block
from torchtitan.models.llama3.infra.parallelize import apply_ddp, disable_fsdp_gradient_division
from torchtitan.tools.logging import logger

from flame.errors import ConfigError
from flame.models.blocks import find_block_list
from flame.models.fla_compile import prepare_fla_for_compile

# Matmul outputs saved by op-level selective AC (the rest is recomputed).
_OP_SAC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.c10d_functional.reduce_scatter_tensor.default,
}

# Linear names of the transformer family (HF llama/qwen, flame's transformer) for TP.
_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")
# Families whose blocks are exactly those linears and whose attention reshapes by the local head
# count (HF: ``view(*shape, -1, head_dim)``; flame's transformer: ``num_heads`` divided below).
# FLA's linear-attention layers have extra projections (gates, convolutions) TP would not shard.
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "transformer")
_HEAD_ATTRS = ("num_heads", "num_kv_heads", "num_key_value_heads", "num_attention_heads")


def check_tp(model: nn.Module, tp: int) -> None:
    """One-line ConfigError when the model cannot be split into ``tp`` tensor-parallel ranks."""
    opt = f"parallelism.tensor_parallel_degree {tp}"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in TP_MODEL_TYPES:
        raise ConfigError(f"{opt}: model type {model_type!r} does not support tensor parallelism "
                          f"(supported: {', '.join(TP_MODEL_TYPES)})")
    for attr in _HEAD_ATTRS:
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"{opt}: model {attr} {heads} is not divisible by it")
    _, _, blocks = find_block_list(model)
    for name, sub in blocks[0].named_modules():
        if name.endswith(("attn", "self_attn", "attention")):
            own = [n for n, _ in sub.named_parameters(recurse=False)]
            if own:
                raise ConfigError(f"{opt}: attention {type(sub).__name__} has per-head parameters "
                                  f"({', '.join(own)}) that tensor parallelism does not shard")


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Megatron-style TP inside each block: column-wise q/k/v/gate/up, row-wise o/down.

    Parameters outside those linears (embeddings, norms, head) stay plain replicated tensors;
    their gradients are identical on every TP rank (the row-wise outputs are all-reduced).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    check_tp(model, tp)
    _, _, blocks = find_block_list(model)
    for i, block in enumerate(blocks):
        plan = {}
        for name, sub in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(sub, nn.Linear) and leaf in _COLWISE:
                plan[name] = ColwiseParallel()
            elif isinstance(sub, nn.Linear) and leaf in _ROWWISE:
                plan[name] = RowwiseParallel()
        if not plan:
            raise ConfigError(
                f"parallelism.tensor_parallel_degree {tp}: block {i} of "
                f"{type(model).__name__} has none of the linears TP knows ({', '.join(_COLWISE + _ROWWISE)})"
            )
        for name, sub in block.named_modules():
            # attention reshapes with the local head count under TP
            for attr in _HEAD_ATTRS:
                if isinstance(getattr(sub, attr, None), int) and name.endswith(("attn", "self_attn", "attention")):
                    setattr(sub, attr, getattr(sub, attr) // tp)
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"Applied tensor parallelism (degree {tp}) to {len(blocks)} blocks")


def apply_ac(model: nn.Module, ac_config) -> None:
    if ac_config.mode == "none":
        return
    if ac_config.mode == "memory_budget":
        raise ConfigError("activation_checkpoint.mode 'memory_budget': not supported by flame; use none|selective|full")
    _, _, blocks = find_block_list(model)
    for i in range(len(blocks)):
        blocks[i] = _apply_ac_to_transformer_block(
            blocks[i], ac_config, base_fqn=f"layers.{i}", op_sac_save_list=_OP_SAC_SAVE
        )
    logger.info(f"Applied {ac_config.mode} activation checkpointing to {len(blocks)} blocks")


def apply_compile(model: nn.Module, compile_config) -> None:
    """Compile each block on its own: small graphs, reused across identical blocks."""
    prepare_fla_for_compile(model)
    _, _, blocks = find_block_list(model)
    for i in range(len(blocks)):
        blocks[i] = torch.compile(blocks[i], backend=compile_config.backend)
    logger.info(f"Compiled {len(blocks)} blocks with torch.compile")


def apply_fsdp(model: nn.Module, mesh, job_config, force_sum: bool) -> None:
    t = job_config.training
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[t.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[t.mixed_precision_reduce],
    )
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if t.enable_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    policy = job_config.parallelism.fsdp_reshard_after_forward
    reshard = policy != "never"
    _, _, blocks = find_block_list(model)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # the root owns embeddings, final norm and head; no reshard since backward needs them first
    fully_shard(model, reshard_after_forward=policy == "always", **kwargs)
    disable_fsdp_gradient_division(model)
    if force_sum:
        # gloo has no PREMUL_SUM, which FSDP picks when its gradient division is disabled
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def prepare_blocks(model: nn.Module, parallel_dims, job_config) -> None:
    """TP, activation checkpointing and per-block compile, in place on the meta model."""
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"))
    apply_ac(model, job_config.activation_checkpoint)
    if job_config.compile.enable:
        apply_compile(model, job_config.compile)


def apply_data_parallel(model: nn.Module, parallel_dims, job_config, device: torch.device) -> None:
    """FSDP2, HSDP or DDP over the data-parallel ranks, in place (nothing with one rank)."""
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(model, parallel_dims.get_mesh(names), job_config, force_sum=device.type == "cpu")
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP2")
    elif parallel_dims.dp_replicate_enabled:
        if parallel_dims.tp_enabled:
            raise ConfigError("DDP with tensor parallelism is not supported: use data_parallel_shard_degree > 1 (FSDP2/HSDP)")
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=job_config.compile.enable)


def parallelize(model: nn.Module, parallel_dims, job_config, device: torch.device) -> nn.Module:
    """Every parallelism of a run without offload applied to a meta model (still on meta: the
    caller materializes it)."""
    prepare_blocks(model, parallel_dims, job_config)
    apply_data_parallel(model, parallel_dims, job_config, device)
    return model
