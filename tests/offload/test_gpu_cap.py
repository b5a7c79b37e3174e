"""The offload cap bounds the whole process on the GPU (skipped without CUDA): a job trained
through the trainer with the offload engine under `offload.gpu_memory_gib` keeps its peak
reserved memory plus the driver memory outside torch's allocator (CUDA context, kernel modules)
within the cap."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer.helpers import PYTHONPATH, ROOT, free_port, metrics, tiny_job

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GiB = 1024**3
CAP_GIB = 4.0

# 0.5 B parameters: 8 GB of fp32 master weights, gradients and moments, twice the cap
MODEL = {"model_type": "llama", "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
         "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
         "tie_word_embeddings": False}

TRAIN = """
import json, sys
import torch
from tests.trainer.helpers import train_in_process
from flame.offload.measure.hardware import outside_allocator_bytes
trainer = train_in_process(json.loads(sys.argv[1]))
print("RESULT", json.dumps({"offloaded": trainer.parts.weights is not None,  # the engine holds the weights
                            "outside_allocator_bytes": outside_allocator_bytes(torch.device("cuda", 0)),
                            "reserved_now": torch.cuda.memory_reserved(0)}))
"""


def test_peak_reserved_plus_context_stays_within_the_cap(tmp_path):
    config = tmp_path / "model.json"
    config.write_text(json.dumps(MODEL))
    dump = str(tmp_path / "dump")
    # the job counts every byte on the GPU outside its own allocator against its cap, this pytest
    # process's CUDA context and what earlier GPU tests left included: those bytes are not the
    # job's, so its cap is CAP_GIB on top of them, and the job's own use is the subject
    others = 0
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(0)
        others = total - free
    cap_gib = CAP_GIB + math.ceil(others / GiB * 100) / 100
    args = tiny_job(dump, "--training.steps", "6", "--training.batch_size", "2", "--training.seq_len", "1024",
                    "--offload.enable", "on", "--offload.gpu_memory_gib", str(cap_gib), "--checkpoint.no-enable",
                    config=str(config), precision=None)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env.update(PYTHONPATH=PYTHONPATH, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(args)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    records = [r for r in metrics(dump) if "memory_peak_gib" in r]
    assert result["offloaded"] and len(records) == 6
    peak_reserved = max(r["memory_peak_gib"] for r in records) * GiB
    peak_allocated = max(r["memory_active_gib"] for r in records) * GiB
    outside = result["outside_allocator_bytes"] - others
    process_peak = peak_reserved + outside
    print(f"cap {CAP_GIB} GiB: peak reserved {peak_reserved / GiB:.2f} GiB + outside the allocator "
          f"{outside / GiB:.2f} GiB = {process_peak / GiB:.2f} GiB (peak allocated {peak_allocated / GiB:.2f} "
          f"GiB; other processes' memory on the GPU {others / GiB:.2f} GiB)")
    assert process_peak <= CAP_GIB * GiB
    # the cap binds: the plan used most of what it was given (the cap less the others' memory)
    assert peak_allocated > 0.5 * (CAP_GIB * GiB - others)
