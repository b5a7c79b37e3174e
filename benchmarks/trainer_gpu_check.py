"""Issue-2 acceptance on a GPU: 340M models train 50 steps through train.sh; a run split at
step 25 and relaunched resumes from its checkpoint and continues the same loss sequence.

usage: python benchmarks/trainer_gpu_check.py OUT_JSON MODEL [MODEL ...]   (MODEL: configs/<MODEL>.json)
Prints a table and writes JSON (device, torch version, command, date, per-model numbers).
"""

import datetime
import json
import os
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.environ.get("FLAME_RUNS", "/tmp/flame_runs")


def job(model: str, dump: str, steps: int, nproc: int) -> list[str]:
    return [
        "bash", os.path.join(ROOT, "train.sh"),
        "--job.config_file", os.path.join(ROOT, "flame/models/fla.toml"),
        "--model.config", os.path.join(ROOT, f"configs/{model}.json"),
        "--model.tokenizer_path", os.path.join(ROOT, "flame/assets/tokenizer"),
        "--training.dataset", os.path.join(ROOT, "flame/assets/sample_corpus"),
        "--training.batch_size", "4", "--training.seq_len", "2048", "--training.num_workers", "2",
        "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "10", "--lr_scheduler.total_steps", "50",
        "--optimizer.lr", "1e-3", "--metrics.log_freq", "1", "--checkpoint.interval", "25",
        "--checkpoint.keep_latest_k", "2", "--job.dump_folder", dump, "--offload.enable", "off",
    ]


def run(cmd: list[str], nproc: int) -> None:
    env = dict(os.environ, NGPU=str(nproc), PYTHON=sys.executable)
    print("running:", " ".join(cmd[-14:]), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=int(os.environ.get("RUN_TIMEOUT", "240")))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def records(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if '"loss"' in l]


def check(model: str, nproc: int) -> dict:
    full, split = f"{RUNS}/{model}-n{nproc}-full", f"{RUNS}/{model}-n{nproc}-split"
    for d in (full, split):  # metrics.jsonl appends across launches: start clean
        shutil.rmtree(d, ignore_errors=True)
    # the uninterrupted run writes no checkpoint; the split run saves a full one at step 25,
    # resumes from it, ends with a model-only save and the HF export
    run(job(model, full, 50, nproc) + ["--checkpoint.no-enable-checkpoint", "--checkpoint.no-export-hf"], nproc)
    run(job(model, split, 25, nproc) + ["--checkpoint.no-export-hf"], nproc)
    run(job(model, split, 50, nproc) + ["--checkpoint.last_save_model_weights_only"], nproc)
    a, b = records(full), records(split)
    la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
    steady = a[10:]
    mean = lambda k: sum(r.get(k, 0.0) for r in steady) / len(steady)
    return {
        "model": model, "nproc": nproc, "steps": len(la),
        "loss_first": la[0], "loss_last": la[-1],
        "resume_max_abs_loss_diff": max(abs(x - y) for x, y in zip(la, lb)),
        "resume_steps_compared": min(len(la), len(lb)),
        "tokens_per_second": mean("tokens_per_second"), "tflops_per_device": mean("tflops"),
        "mfu_pct_vs_spec_peak": mean("mfu_pct"), "memory_peak_gib": max(r.get("memory_peak_gib", 0) for r in a),
        "hf_export": os.path.isfile(os.path.join(split, "hf", "config.json")),
        "losses": la, "losses_split_resumed": lb,
    }


def main() -> None:
    out, models = sys.argv[1], sys.argv[2:]
    nproc = int(os.environ.get("CHECK_NPROC", "1"))
    results = []
    for m in models:
        try:
            results.append(check(m, nproc))
        except Exception as e:  # report the failure (with the steps it reached), go on
            partial = {}
            for tag in ("full", "split"):
                try:
                    partial[tag] = [(r["step"], round(r["loss"], 4), round(r["step_time"], 3)) for r in records(f"{RUNS}/{m}-n{nproc}-{tag}")]
                except OSError:
                    pass
            results.append({"model": m, "nproc": nproc, "error": str(e)[-3000:], "reached": partial})
        write(out, results)
    print_table(results)


def write(out: str, results: list) -> None:
    doc = {
        "what": "flame trainer GPU acceptance: 50 steps via train.sh, batch 4 x seq 2048, bf16 autocast, resume at 25",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(sys.argv), "results": results,
        "env": {k: os.environ[k] for k in ("CHECK_NPROC", "FLAME_AUTOTUNE_MAX_CONFIGS") if k in os.environ},
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


def print_table(results: list) -> None:
    print(f"{'model':<22}{'n':>3}{'loss0':>8}{'loss50':>8}{'resume diff':>13}{'tok/s':>10}{'TFLOP/s':>9}{'mem GiB':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<22}{r['nproc']:>3}  ERROR {r['error'][-300:]}")
            continue
        print(f"{r['model']:<22}{r['nproc']:>3}{r['loss_first']:>8.3f}{r['loss_last']:>8.3f}{r['resume_max_abs_loss_diff']:>13.2e}"
              f"{r['tokens_per_second']:>10.0f}{r['tflops_per_device']:>9.1f}{r['memory_peak_gib']:>9.1f}")


if __name__ == "__main__":
    main()
