"""For the torchrun scripts here: a plain single-process model and the same weights parallelized."""

import torch
from torch.distributed.tensor import DTensor

from flame.distributed.parallelize import parallelize
from flame.models import build


def reference_and_parallel(config: str, cfg, parallel_dims, device):
    """(model config, plain model, parallelized model with the plain model's weights)."""
    mc = build.load_model_config(config)
    torch.manual_seed(0)
    ref = build.build_meta_model(mc)
    ref.to_empty(device=device)
    build.init_weights(ref, seed=0)
    state = {k: v.clone() for k, v in ref.state_dict().items()}

    model = build.build_meta_model(build.load_model_config(config))
    model = parallelize(model, parallel_dims, cfg, device)
    model.to_empty(device=device)
    build.init_weights(model, seed=1)  # also re-creates non-persistent buffers (rotary inv_freq)
    if not any(isinstance(p, DTensor) for p in model.parameters()):  # DDP: plain replicated tensors
        model.load_state_dict(state)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
    return mc, ref, model
