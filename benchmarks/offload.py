"""Offload through the product paths, in one device run: flame next to torchtitan's own trainer.

Every row is a real command line in its own process group under a wall cap:
- flame: ``bash train.sh ... --offload.enable on --offload.gpu_memory_gib CAP`` (the trainer as users
  run it; the planner picks the micro-batch among the divisors of the batch);
- torchtitan resident: ``python -m torchtitan.train`` on its llama3 (per-block compile, full AC),
  the local batch largest first until one fits, gradient accumulation up to the same tokens a step;
- torchtitan FSDP2 offload: the same with ``--training.enable_cpu_offload`` (``CPUOffloadPolicy``,
  torchtitan's fused CPU AdamW), the largest micro-batch that fits under the same cap
  (``benchmarks/titan_ext.py`` applies it as flame does and registers the 3B flavor, the bundled
  corpus and the one-GPU FSDP spec; torchtitan's trainer itself is not changed).
Shapes: Llama 3.2-3B with an untied 128256 vocabulary (``benchmarks/configs/llama3_3B.json``,
torchtitan flavor ``3B``) at a 16 GiB cap, and Llama 3 8B (torchtitan's ``8B``) with bf16 states at
24 GiB; 32,768 tokens per optimizer step in every row. Rows a machine cannot hold (8B resident;
8B FSDP2 offload on a host under its fp32 states) are recorded as not run with the reason.

Per row: exit, command, tokens/s and step seconds (median over the second half of the logged
steps), peak reserved GiB (flame's metrics and torchtitan's log both report
``torch.cuda.max_memory_reserved``); flame rows add the planner's predicted step and peak next to
the measured ones (its calibration line, steps 3-5) with their errors.

usage:
    python benchmarks/offload.py OUT.json [--shapes 3B,8B] [--rows a,b] [--steps N] [--budget_s S] [--append]
    python benchmarks/offload.py OUT.json --lanes "a,b;c,d"   # lanes at once, each on a GPU of its own
Every row runs on one GPU (the first visible one, or its lane's), flame's as torchtitan's.
    python benchmarks/offload.py --list          # rows and their command lines (any machine, no GPU)
    python benchmarks/offload.py --markdown OUT.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from acceptance import (GROUP_EXIT_WAIT_S, commit, device_info, gpu_slots, metric_lines, records, row_time,  # noqa: E402
                        run_in_group, versions, write_markdown)

TOML = os.path.join(ROOT, "flame/models/fla.toml")
TOKENIZER = os.path.join(ROOT, "flame/assets/tokenizer")
CORPUS = os.path.join(ROOT, "flame/assets/sample_corpus")
TOKENS_PER_STEP = 32768
GiB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    flame_config: str
    titan_flavor: str
    seq: int
    cap_gib: float
    flame_extra: tuple = ()
    """flame options of this shape's offload rows (e.g. bf16 states)."""


SHAPES = {
    "3B": Shape("3B", "benchmarks/configs/llama3_3B.json", "3B", 4096, 16.0),
    "8B": Shape("8B", "benchmarks/configs/llama3_8B.json", "8B", 8192, 24.0,
                ("--offload.master_dtype", "bfloat16", "--offload.moment_dtype", "bfloat16",
                 "--offload.grad_dtype", "bfloat16")),
}


@dataclass
class BenchRow:
    name: str
    shape: str
    framework: str
    """flame | torchtitan"""
    mode: str
    """offload (flame's engine) | resident | fsdp2_offload"""
    what: str
    args: list[str]
    """Options after the launcher (``bash train.sh`` or ``torchrun -m torchtitan.train``), without the dump folder."""
    cap_s: int
    search: str = ""
    """Rows sharing a search name are tried in order; the first that finishes is the search's result."""
    env: dict = field(default_factory=dict)
    state_bytes_per_param: int = 0
    """Bytes per parameter of master weights, gradients and moments, for the fit check below."""
    state_on: str = ""
    """gpu | host: where those bytes must fit (torchtitan rows), else no check."""


def flame_args(shape: Shape, steps: int, compile_: bool) -> list[str]:
    batch = TOKENS_PER_STEP // shape.seq
    return [
        "--job.config_file", TOML, "--model.config", os.path.join(ROOT, shape.flame_config),
        "--model.tokenizer_path", TOKENIZER, "--training.dataset", CORPUS,
        "--training.batch_size", str(batch), "--training.seq_len", str(shape.seq), "--training.steps", str(steps),
        "--training.num_workers", "2", "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1", "--checkpoint.no-enable-checkpoint", "--checkpoint.no-export-hf",
        *(["--training.compile"] if compile_ else []),
        "--offload.enable", "on", "--offload.gpu_memory_gib", f"{shape.cap_gib:g}", *shape.flame_extra,
    ]


def titan_args(shape: Shape, steps: int, local_batch: int, cpu_offload: bool) -> list[str]:
    return [
        "--model.name", "llama3_fsdp1" if cpu_offload else "llama3", "--model.flavor", shape.titan_flavor,
        "--model.hf_assets_path", TOKENIZER, "--experimental.custom_import", "benchmarks.titan_ext",
        "--training.dataset", "flame_sample", "--training.local_batch_size", str(local_batch),
        "--training.global_batch_size", str(TOKENS_PER_STEP // shape.seq), "--training.seq_len", str(shape.seq),
        "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16",
        "--activation_checkpoint.mode", "full", "--compile.enable", "--metrics.log_freq", "1",
        "--optimizer.lr", "3e-4", "--lr_scheduler.warmup_steps", "2", "--training.max_norm", "1.0",
        *(["--training.enable_cpu_offload"] if cpu_offload else []),
    ]


# the compiled flame rows of each shape: (row name suffix, what it adds, its options)
NOCLIP = ("--training.max_norm", "0")
COMPILED_VARIANTS = (
    ("", "the same with --training.compile", ()),
    ("_speculative", "the same with --offload.speculative_step (CPU AdamW during the backward)",
     ("--offload.speculative_step",)),
    ("_checkpoint_offload", "the same with --offload.checkpoint_offload (recomputed blocks' inputs in host memory)",
     ("--offload.checkpoint_offload",)),
    ("_checkpoint_offload_speculative", "the same with --offload.checkpoint_offload and --offload.speculative_step "
     "(clipping on: a clipped step redoes its speculative updates)",
     ("--offload.checkpoint_offload", "--offload.speculative_step")),
    # clipping on, at a threshold the early grad norms (5-46 at 3B) stay under: every step keeps its
    # speculative update, as steps do once a clipped run's norms fall below max_norm
    ("_checkpoint_offload_speculative_maxnorm100", "the same with --offload.checkpoint_offload and "
     "--offload.speculative_step, clipping at --training.max_norm 100 (no step clips here: the speed of a "
     "clipped run's steps that do not clip; spare state in host memory)",
     ("--offload.checkpoint_offload", "--offload.speculative_step", "--training.max_norm", "100")),
    ("_checkpoint_offload_speculative_noclip", "the same with --offload.checkpoint_offload and "
     "--offload.speculative_step, without clipping (--training.max_norm 0)",
     ("--offload.checkpoint_offload", "--offload.speculative_step", *NOCLIP)),
    ("_speculative_noclip", "the same without clipping (--training.max_norm 0): the speed of steps that do not clip, "
     "which keep their speculative update", ("--offload.speculative_step", *NOCLIP)),
    # nothing can redo a step: the speculative update goes into the state, no spare master and moments
    ("_checkpoint_offload_speculative_noclip_noskip", "the same with --offload.checkpoint_offload and "
     "--offload.speculative_step, without clipping or NaN skipping (--training.max_norm 0 "
     "--training.no-skip_nan_inf): in place, no spare state",
     ("--offload.checkpoint_offload", "--offload.speculative_step", *NOCLIP, "--training.no-skip_nan_inf")),
    # fewer CPU AdamW threads than the default (cores - 1): whether the speculative step's AdamW
    # slows beside the backward for want of cores or of host memory bandwidth
    *((f"_checkpoint_offload_speculative_noclip_t{n}", f"the same with --offload.checkpoint_offload and "
       f"--offload.speculative_step, without clipping, {n} CPU AdamW threads (--offload.cpu_threads {n})",
       ("--offload.checkpoint_offload", "--offload.speculative_step", *NOCLIP, "--offload.cpu_threads", str(n)))
      for n in (12, 8)),
)


def all_rows(steps: int, shapes=("3B", "8B")) -> list[BenchRow]:
    rows = []
    for key in shapes:
        s = SHAPES[key]
        seqs = TOKENS_PER_STEP // s.seq
        # micro-batches tried, largest first: the resident states alone take 16 bytes a parameter
        # (58 GiB of an 80 GiB card at 3B) and the float32 logits 2 GiB a 4096-token sequence, so
        # 8 sequences cannot fit; under a 16 GiB cap neither can 4
        resident = [b for b in (4, 2, 1) if b <= seqs and seqs % b == 0]
        capped = [b for b in (2, 1) if b <= seqs and seqs % b == 0]
        states = "bf16 states" if s.flame_extra else "fp32 master and moments"
        rows.append(BenchRow(f"flame_{key}_offload_{s.cap_gib:g}GiB", key, "flame", "offload",
                             f"flame {key}, {seqs} x {s.seq}, offload at {s.cap_gib:g} GiB, {states}",
                             flame_args(s, steps, False), 420))
        for suffix, what, extra in COMPILED_VARIANTS:
            rows.append(BenchRow(f"flame_{key}_offload_{s.cap_gib:g}GiB_compile{suffix}", key, "flame", "offload",
                                 what, flame_args(s, steps, True) + list(extra), 420))
        for b in resident:
            rows.append(BenchRow(f"titan_{key}_resident_b{b}", key, "torchtitan", "resident",
                                 f"torchtitan llama3 {key}, {b} x {s.seq} x {seqs // b} accumulation, per-block "
                                 "compile, full AC", titan_args(s, steps, b, False), 360,
                                 search=f"titan_{key}_resident", state_bytes_per_param=16, state_on="gpu"))
        for b in capped:
            rows.append(BenchRow(f"titan_{key}_fsdp2_offload_{s.cap_gib:g}GiB_b{b}", key, "torchtitan", "fsdp2_offload",
                                 f"torchtitan llama3 {key}, FSDP2 CPUOffloadPolicy at {s.cap_gib:g} GiB, {b} x {s.seq} x "
                                 f"{seqs // b} accumulation, full AC", titan_args(s, min(steps, 4), b, True), 480,
                                 search=f"titan_{key}_fsdp2_offload",
                                 env={"FLAME_BENCH_GPU_CAP_GIB": f"{s.cap_gib:g}"},
                                 state_bytes_per_param=16, state_on="host"))
    return rows


def launcher(row: BenchRow) -> list[str]:
    if row.framework == "flame":
        return ["bash", os.path.join(ROOT, "train.sh")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "torchtitan.train"]


def command(row: BenchRow, dump: str) -> list[str]:
    saved = ["--offload.save_plan", os.path.join(dump, "plan.json")] if row.framework == "flame" else []
    return [*launcher(row), *row.args, "--job.dump_folder", dump, *saved]


ANSI = re.compile(r"\x1b\[[0-9;]*m")
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
CALIBRATION = re.compile(r"step predicted ([\d.eE+-]+) s, measured ([\d.eE+-]+) s .*?peak GPU predicted ([\d.]+) GiB, "
                         r"measured ([\d.]+) GiB")
CALIBRATION_RESERVED = re.compile(r"offload calibration .*reserved predicted ([\d.]+) GiB")


def titan_steps(console: str) -> list[dict]:
    """torchtitan's per-step log lines: step, loss, peak reserved GiB, tokens/s per device."""
    out = []
    for m in TITAN_STEP.finditer(ANSI.sub("", console)):
        out.append({"step": int(m.group(1)), "loss": float(m.group(2)), "memory_peak_gib": float(m.group(3)),
                    "tokens_per_second": float(m.group(4).replace(",", ""))})
    return out


def planner_report(console: str) -> dict:
    """flame's offload calibration line: predicted and measured step and (allocated) peak."""
    m = CALIBRATION.search(console)
    if not m:
        return {}
    pred_s, meas_s, pred_peak, meas_peak = (float(g) for g in m.groups())
    out = {"predicted_step_s": pred_s, "calibration_step_s": meas_s, "predicted_peak_gib": pred_peak,
           "measured_peak_allocated_gib": meas_peak}
    reserved = CALIBRATION_RESERVED.search(console)  # planners from 2026-11-27 on predict reserved too
    if reserved:
        out["predicted_peak_reserved_gib"] = float(reserved.group(1))
    return out


def offload_log(console: str) -> list[str]:
    """flame's offload log records, with the lines that continue one (the plan's description)."""
    out, keep = [], False
    for line in ANSI.sub("", console).splitlines():
        if "flame.offload" in line:
            out.append(line.split(" - ", 3)[-1])
            keep = True
        elif keep and line.startswith("  "):
            out.append(line)
        else:
            keep = False
    return out[-80:]


def offload_scalars(metrics_path: str) -> dict:
    """The offload calibration's scalars (``offload/*``) of a flame run's metrics.jsonl."""
    return {k: v for rec in metric_lines(metrics_path) for k, v in rec.items() if k.startswith("offload/")}


def summarize(steps: list[dict]) -> dict:
    """Median tokens/s over the second half of the steps, their step seconds, the reserved peak."""
    half = steps[len(steps) // 2:] if len(steps) >= 2 else steps
    tps = [s["tokens_per_second"] for s in half if s.get("tokens_per_second")]
    if not tps:
        return {"tokens_per_second": None, "step_s": None,
                "peak_reserved_gib": max((s.get("memory_peak_gib", 0.0) for s in steps), default=None)}
    rate = statistics.median(tps)
    return {"tokens_per_second": round(rate), "step_s": round(TOKENS_PER_STEP / rate, 3),
            "peak_reserved_gib": round(max(s.get("memory_peak_gib", 0.0) for s in steps), 2),
            "loss_first": steps[0].get("loss"), "loss_last": steps[-1].get("loss")}


def fit_problem(row: BenchRow) -> str | None:
    """Why this machine cannot hold the row's states (None: it can, or the row is not checked)."""
    if not row.state_on:
        return None
    from flame.models.build import load_model_config
    from flame.models.flops import param_counts

    n = param_counts(load_model_config(os.path.join(ROOT, SHAPES[row.shape].flame_config)))["total"]
    need = n * row.state_bytes_per_param
    if row.state_on == "gpu":
        import torch

        have = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        return (f"{n / 1e9:.2f} B parameters x {row.state_bytes_per_param} bytes of states = {need / GiB:.0f} GiB "
                f"> the {row.state_on}'s {have / GiB:.0f} GiB")
    return None


def run_bench_row(row: BenchRow, runs: str, cap_s: float, gpu: str | None = None,
                  exit_wait_s: float = GROUP_EXIT_WAIT_S) -> dict:
    dump = os.path.join(runs, row.name)
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    cmd = command(row, dump)
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", **row.env)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    log_path = os.path.join(dump, "console.log")
    metrics = os.path.join(dump, "metrics.jsonl")
    started = (lambda: bool(records(metrics))) if row.framework == "flame" else None
    rc, wall, first = run_in_group(cmd, env, log_path, cap_s, started, exit_wait_s)
    with open(log_path, errors="replace") as f:
        console = f.read()
    steps = records(metrics) if row.framework == "flame" else titan_steps(console)
    out = {"row": row.name, "shape": row.shape, "framework": row.framework, "mode": row.mode, "what": row.what,
           "exit": rc, "wall_s": round(wall, 1), "first_step_s": None if first is None else round(first, 1),
           "steps_logged": len(steps), **summarize(steps)}
    if row.framework == "flame":
        pr = planner_report(console)
        out.update(pr)
        # where the step's time goes, for the findings: the calibration's scalars and the planner's log
        out["offload_report"] = offload_scalars(metrics)
        # clipped steps (norm above --training.max_norm) redo a speculative CPU step
        out["grad_norms"] = [round(r["grad_norm"], 3) for r in steps if isinstance(r.get("grad_norm"), (int, float))]
        out["offload_log"] = offload_log(console)
        # the plan the run executed and the profile it was solved with: the calculator replays
        # both (`python -m flame.offload.plan --offload.profile ...`) to explain a row off-device
        for key, name in (("plan", "plan.json"), ("profile", "offload_profile.json")):
            path = os.path.join(dump, name)
            if os.path.isfile(path):
                with open(path) as f:
                    out[key] = json.load(f)
        if pr and out["step_s"]:
            out["step_error"] = round(out["step_s"] / pr["predicted_step_s"] - 1, 4)
            out["peak_allocated_error"] = round(pr["measured_peak_allocated_gib"] / pr["predicted_peak_gib"] - 1, 4)
            # against the planner's reserved prediction where it makes one (else its allocated one)
            out["peak_reserved_error"] = round(out["peak_reserved_gib"] / pr.get("predicted_peak_reserved_gib",
                                                                                pr["predicted_peak_gib"]) - 1, 4)
    if rc != 0:
        lines = [line for line in ANSI.sub("", console).splitlines() if line.strip()]
        errs = [line for line in lines if "flame: error" in line or "Error" in line or "error:" in line]
        # an out-of-memory crash under offload: the engine's buffers against the plan's (one line)
        memory = [line for line in lines if "offload: GPU memory" in line][-1:]
        out["error_tail"] = "\n".join(memory + ["\n".join(errs[-6:] + lines[-20:])[-3000:]])
    return out


def markdown(doc: dict) -> str:
    d = doc["device"]
    head = (f"{d['name']} x{d['count']}; " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
            + f"; commit {doc['commit'][:10]}; {doc['date'][:10]}; {TOKENS_PER_STEP:,} tokens per optimizer step")
    lines = [head, "", "| row | what | exit | tokens/s | step s | peak reserved GiB | planner step s (error) | "
             "planner peak GiB (error vs reserved) |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in doc["results"]:
        if r.get("exit") == "not run":
            lines.append(f"| {r['row']} | {r['what']} | not run: {r['reason']} | | | | | |")
            continue
        pred = (f"{r['predicted_step_s']:.2f} ({100 * r['step_error']:+.0f}%)" if "step_error" in r else "-")
        peak = (f"{r.get('predicted_peak_reserved_gib', r['predicted_peak_gib']):.1f} "
                f"({100 * r['peak_reserved_error']:+.0f}%)" if "peak_reserved_error" in r else "-")
        lines.append(f"| {r['row']} | {r['what']} | {r['exit']} | {fmt(r['tokens_per_second'], ',')} | "
                     f"{fmt(r['step_s'], '.2f')} | {fmt(r['peak_reserved_gib'], '.1f')} | {pred} | {peak} |")
    if doc.get("lanes"):
        lines += ["", "Lanes that ran at once, each on a GPU of its own (the host was shared): "
                  + "; ".join(" -> ".join(lane) for lane in doc["lanes"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--shapes", default="3B,8B", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--rows", default="", help="comma list of row names (default: every row of --shapes)")
    ap.add_argument("--lanes", default="", help="rows in lanes, ';' between lanes: the lanes run at once, each "
                    "on a GPU of its own, the rows of a lane one after another")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps a row (FSDP2 offload rows: at most 4)")
    ap.add_argument("--budget_s", type=float, default=570, help="stop starting rows after this many seconds")
    ap.add_argument("--runs", default=os.environ.get("FLAME_RUNS", "/tmp/flame_offload_bench"))
    ap.add_argument("--append", action="store_true", help="keep OUT.json's rows of other names (several device calls)")
    ap.add_argument("--list", action="store_true", help="print the rows and their command lines")
    ap.add_argument("--markdown", metavar="JSON")
    a = ap.parse_args(argv)
    if a.markdown:
        with open(a.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}")
    rows = all_rows(a.steps, shapes)
    names = [n for n in a.rows.split(",") if n]
    if a.lanes and names:
        ap.error("give --rows or --lanes, not both")
    lane_names = [[n for n in lane.split(",") if n] for lane in a.lanes.split(";")] if a.lanes else []
    names = names or [n for lane in lane_names for n in lane]
    unknown = [n for n in names if n not in {r.name for r in rows}]
    if unknown:
        ap.error(f"unknown rows {unknown}; --list shows them")
    chosen = [r for r in rows if not names or r.name in names]
    by_name = {r.name: r for r in rows}
    lanes = [[by_name[n] for n in lane] for lane in lane_names if lane] or [chosen]
    if a.list:
        for r in chosen:
            print(f"{r.name}  ({r.what})\n    {' '.join(command(r, os.path.join(a.runs, r.name)))}")
        return 0
    if not a.out:
        ap.error("OUT.json is required")
    doc = {"what": "offload through the product paths: flame's train.sh next to torchtitan's trainer",
           "device": device_info(), "versions": versions(), "commit": commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
           "tokens_per_step": TOKENS_PER_STEP, "results": []}
    if a.append and os.path.isfile(a.out):
        with open(a.out) as f:
            old = json.load(f)
        doc["results"] = [r for r in old.get("results", []) if r["row"] not in {c.name for c in chosen}]
        doc["earlier_calls"] = old.get("earlier_calls", []) + [{k: old[k] for k in ("device", "commit", "date", "command")
                                                                 if k in old}]
    t0 = time.perf_counter()
    found = set()  # searches that have their result
    lock = threading.Lock()

    def run_lane(lane: list[BenchRow], gpu: str | None) -> None:
        for row in lane:
            with lock:
                searched = bool(row.search and row.search in found)
            if searched:
                res = {"exit": "not run", "reason": f"{row.search}: a larger batch fit"}
            elif (why := fit_problem(row)) is not None:
                res = {"exit": "not run", "reason": why}
            elif (left := a.budget_s - (time.perf_counter() - t0)) < 60:
                res = {"exit": "not run", "reason": "out of the call's time budget"}
            else:
                print(f"== {row.name} (GPU {gpu}): {row.what}", flush=True)
                cap, exit_wait = row_time(row.cap_s, left)
                res = run_bench_row(row, a.runs, cap, gpu, exit_wait)
                if gpu is not None:
                    res["gpu"] = gpu
            res = {"row": row.name, "shape": row.shape, "framework": row.framework, "mode": row.mode,
                   "what": row.what, "command": " ".join(command(row, os.path.join(a.runs, row.name))), **res}
            res["device"] = doc["device"]["name"]
            with lock:
                if row.search and res["exit"] == 0:
                    found.add(row.search)
                doc["results"].append(res)
                print(json.dumps({k: v for k, v in res.items() if k not in ("command", "error_tail")}), flush=True)
                with open(a.out, "w") as f:
                    json.dump(doc, f, indent=1)

    if len(lanes) == 1:
        # one GPU, as torchtitan's rows run: train.sh would start a rank per visible GPU
        run_lane(lanes[0], gpu_slots(1)[0][0])
    else:
        # each lane on a GPU of its own; the host (cores, memory bandwidth) is shared, which the
        # JSON records as the lanes that ran at once
        doc["lanes"] = [[r.name for r in lane] for lane in lanes]
        slots, _ = gpu_slots(len(lanes))
        threads = [threading.Thread(target=run_lane, args=(lane, gpu)) for lane, gpu in zip(lanes, slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    order = {r.name: i for i, r in enumerate(chosen)}
    doc["results"].sort(key=lambda r: order.get(r["row"], -1))
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(a.out, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
