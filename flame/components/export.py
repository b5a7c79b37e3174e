"""Export the trained weights as a Hugging Face folder at the end of training."""

import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchtitan.tools.logging import logger


def export_trained_model(trainer, out_dir: str | None = None) -> str:
    """Gather the full (unsharded) weights to rank 0's CPU memory and write ``DUMP/hf``.

    Every rank must call this (the gather is a collective); only rank 0 writes.
    """
    from flame.utils.hf_export import export_hf

    cfg = trainer.cfg
    out_dir = out_dir or os.path.join(cfg.job.dump_folder, "hf")
    if trainer.offload is not None:  # master weights live in the engine (one process)
        state = {k: v.detach().cpu() for k, v in trainer.offload.model_state_dict().items()}
    else:
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() == 0:
        export_hf(state, trainer.model_config, trainer.tokenizer, out_dir, dtype=cfg.checkpoint.export_dtype, overwrite=True)
        logger.info(f"Exported Hugging Face model to {out_dir}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out_dir
