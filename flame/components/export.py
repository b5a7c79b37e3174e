"""Export the trained weights as a Hugging Face folder at the end of training, and optionally
upload it to the Hugging Face Hub in the background."""

import os
import threading

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchtitan.tools.logging import logger

from flame.errors import first_line


def export_trained_model(trainer, out_dir: str | None = None) -> str:
    """Gather the full (unsharded) weights to rank 0's CPU memory and write ``DUMP/hf``.

    Every rank must call this (the gather is a collective); only rank 0 writes.
    """
    from flame.utils.hf_export import export_hf

    cfg = trainer.cfg
    out_dir = out_dir or os.path.join(cfg.job.dump_folder, "hf")
    if trainer.parts.weights is not None:  # the weights are not the model's (the offload engine's masters)
        state = {k: v.detach().cpu() for k, v in trainer.parts.weights.state_dict().items()}
    else:
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    lora = cfg.lora if cfg.lora.rank > 0 else None  # adapters merged into the weights; PEFT files on request
    adapter_dir = f"{out_dir.rstrip(os.sep)}_adapter" if lora is not None and lora.export_adapters else None
    if torch.distributed.get_rank() == 0:
        export_hf(state, trainer.model_config, trainer.tokenizer, out_dir, dtype=cfg.checkpoint.export_dtype, overwrite=True,
                  lora=lora, adapter_dir=adapter_dir, base_model=getattr(cfg.model, "init_from", None) or None)
        logger.info(f"Exported Hugging Face model to {out_dir}" + (" (LoRA merged)" if lora is not None else ""))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out_dir


class HFUpload:
    """Upload of an exported folder to a Hub model repository in a daemon thread.

    Off the training path: the thread starts after the final export, the trainer waits for it
    at ``close()`` for at most ``timeout`` seconds. Any failure (no network, no token, no
    permission) is one warning line; it never raises into the trainer.
    """

    def __init__(self, folder: str, repo_id: str, step: int):
        self.folder, self.repo_id, self.step = folder, repo_id, step
        self.error: str | None = None
        self.done = False
        self.thread = threading.Thread(target=self._run, name="flame-hf-upload", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(self.repo_id, repo_type="model", private=True, exist_ok=True)  # private if new
            info = api.upload_folder(folder_path=self.folder, repo_id=self.repo_id, repo_type="model",
                                     commit_message=f"flame: weights after step {self.step}")
            self.done = True
            logger.info(f"flame: uploaded {self.folder} to the Hugging Face Hub repo {self.repo_id} ({getattr(info, 'commit_url', info)})")
        except Exception as e:  # noqa: BLE001  (an upload never stops training)
            self.error = f"{type(e).__name__}: {first_line(e)}"
            logger.warning(f"flame: HF upload of {self.folder} to {self.repo_id} failed: {self.error} (no network?)")

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the upload finished (either way)."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            logger.warning(f"flame: HF upload of {self.folder} to {self.repo_id} still running after "
                           f"{timeout:.0f} s; not waiting longer (checkpoint.hf_upload_timeout_seconds)")
            return False
        return True


def maybe_upload(trainer, folder: str) -> HFUpload | None:
    """Start the background upload of ``folder`` on rank 0 when ``checkpoint.hf_upload_enabled``."""
    ck = trainer.cfg.checkpoint
    if not ck.hf_upload_enabled or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return None
    logger.info(f"flame: uploading {folder} to the Hugging Face Hub repo {ck.hf_repo_base_name} in the background")
    return HFUpload(folder, ck.hf_repo_base_name, trainer.step)
