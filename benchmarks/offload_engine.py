"""The offload engine driven directly (not through the trainer), one device run (JSON + markdown).

Planner-accuracy work: phase-by-phase timing, the engine's memory split and host seconds, the
engine rows that `offload_blocks.py` and `offload_predict.py` read. The product-path comparison
(flame through `train.sh` next to torchtitan's own trainer) is `benchmarks/offload.py`.

(a) 3B Llama-shaped model at a 16 GiB GPU cap (offload engine) vs fully resident (plain torch,
    fp32 master + autocast bf16, fused GPU AdamW) vs FSDP2 CPUOffloadPolicy (world 1);
(b) 8B Llama-shaped model with bf16 states at a 24 GiB cap: useful TFLOP/s vs the measured
    bf16 GEMM ceiling, at 1 x 8192 and at 4 x 8192 tokens per step (row b_..._32k);
(o) the 8B at a 40 GiB cap and 4 x 8192 tokens a step, where the planner offloads some blocks'
    activations to the host instead of recomputing them, next to the same run with that option off;
(c) predicted vs measured step time and peak GPU memory of every engine run, with the engine's
    memory split into static (its own buffers: memory_report) and what a step adds on top, the
    engine's host seconds by kind, and one more step timed phase by phase (forward and backward
    of each round, the optimizer) next to the cost model's phases.
(a) runs --a_rounds sequences of 4096 tokens per optimizer step in every row: the resident and
FSDP2 rows one sequence per pass; the engine rows with the micro-batch the planner picks among the
divisors (as the trainer does), so every row trains the same tokens per step.
Every row runs in its own process (a row's memory cannot OOM the next one) under a wall cap, so
the whole script fits one device call.
All models: activation checkpointing where the baseline needs it to fit, seq 4096/8192.
Usage: python benchmarks/offload_engine.py OUT_DIR [--sections a,b] [--steps 3] [--a_rounds 8] [--budget_s 520]
       [--loss_chunk_tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.components.chunked_loss import chunked_head_loss, install_chunked_head, take_chunked_loss  # noqa: E402
from flame.offload.measure.calibration import measure_block_fudges  # noqa: E402
from flame.offload.measure.hardware import measure  # noqa: E402
from flame.offload.measure.tracing import model_costs  # noqa: E402
from flame.offload.planner.cost_model import Dtypes  # noqa: E402
from flame.offload.planner.hardware import save  # noqa: E402
from flame.offload.planner.refit import use_block_calibration  # noqa: E402
from flame.offload.planner.solver import describe, solve_micro_batches  # noqa: E402
from flame.offload.runtime.engine import OffloadEngine  # noqa: E402

GiB = 1024**3


def llama(size: str):
    from transformers import LlamaConfig

    if size == "3B":
        c = LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    elif size == "8B":
        c = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    else:  # small smoke size
        c = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=32000)
    c._attn_implementation = "sdpa"
    c.use_cache = False  # training: no KV cache
    return c


# host_seconds kinds of the CPU optimizer step (HostOptimizer._cpu_step)
OPTIMIZER_KINDS = ("grad_to_master_dtype", "cpu_adam", "new_compute_copy")
LOSS_CHUNK = {"tokens": 0}  # --loss_chunk_tokens: every row computes its loss the same way


def prepare_loss(model) -> None:
    if LOSS_CHUNK["tokens"]:
        # not a submodule attribute: the head must not be registered a second time
        object.__setattr__(model, "_bench_head", install_chunked_head(model, LOSS_CHUNK["tokens"]))


def loss_of(model, ids):
    head = getattr(model, "_bench_head", None)
    if head is None:
        logits = model(ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(0, 1))
    with chunked_head_loss(head, ids):
        out = model(ids).logits
    return take_chunked_loss(head, out) / ids.numel()


def checkpoint_blocks(model):
    from torch.utils.checkpoint import checkpoint

    for b in model.model.layers:
        f = b.forward
        b.forward = lambda *a, _f=f, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def timed(step, warm: int, steps: int) -> float:
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def run_resident(cfg, mb, seq, rounds, steps):
    torch.manual_seed(0)
    with torch.device("cuda"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    checkpoint_blocks(model)
    prepare_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")

    def step():
        for _ in range(rounds):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                l = loss_of(model, ids) / rounds
            l.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    torch.cuda.reset_peak_memory_stats()
    s = timed(step, 1, steps)
    out = {"step_s": s, "tokens_per_s": mb * seq * rounds / s, "peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    del model, opt
    torch.cuda.empty_cache()
    return out


def run_fsdp2_offload(cfg, mb, seq, rounds, steps):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    checkpoint_blocks(model)
    prepare_loss(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.model.layers:
        fully_shard(b, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    torch.cuda.empty_cache()
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except Exception:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")

    def step():
        for _ in range(rounds):
            l = loss_of(model, ids) / rounds
            l.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    step()  # warm-up step, timed: if the row is killed later, it bounds the steady step from above
    torch.cuda.synchronize()
    _partial({"warmup_step_s": time.perf_counter() - t, "tokens_per_step": mb * seq * rounds})
    s = timed(step, 0, steps)
    out = {"step_s": s, "tokens_per_s": mb * seq * rounds / s, "peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    del model, opt
    torch.cuda.empty_cache()
    return out


def run_engine(cfg, prof, dt, cap_gib, seq, step_sequences, steps, model_dtype, offload_activations=False,
               selective_recompute=True):
    """One engine row: `step_sequences` sequences of `seq` tokens per optimizer step, the micro-batch
    chosen by the planner among the divisors (as the trainer does). Under torchrun (section m)
    every rank runs it on its own GPU with its host state sharded over the ranks; tokens/s is
    then global and memory is rank 0's."""
    from transformers import AutoModelForCausalLM

    from flame.offload import agree_on_plan, optimizer_threads

    world = dist_world()
    costs_of = model_costs(cfg, getattr(torch, dt.compute), [mb for mb in range(1, step_sequences + 1)
                                                              if step_sequences % mb == 0], seq,
                           loss_chunk_tokens=LOSS_CHUNK["tokens"])
    # host budget: the machine's RAM minus 16 GiB (other sections' memory may not be returned to
    # the OS yet, so MemAvailable would understate it)
    host = prof.host_total_bytes - 16 * GiB
    cals = measure_block_fudges(cfg, costs_of, prof, seq, getattr(torch, dt.compute))
    print("block calibration", cals, flush=True)
    # per rank: the host (one machine) is shared by the ranks
    threads = optimizer_threads(len(os.sched_getaffinity(0)), world)
    plan, costs = solve_micro_batches(costs_of, step_sequences, prof, dt, int(cap_gib * GiB), host // world, threads,
                                      fudges=use_block_calibration(costs_of, cals), depths=(1, 2, 3),
                                      world=world, node_ranks=world, offload_activations=offload_activations,
                                      selective_recompute=selective_recompute)
    plan = agree_on_plan(plan)
    costs = costs_of[plan.micro_batch]
    mb, rounds = plan.micro_batch, plan.rounds
    cal = cals[mb]
    text = describe(plan, costs)
    print(text, flush=True)
    torch.manual_seed(0)  # the same initial weights on every rank
    t0 = time.perf_counter()
    mem = {"before_model": torch.cuda.memory_allocated()}  # what earlier work in this process left
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=model_dtype)
    prepare_loss(model)
    mem["after_model"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = OffloadEngine(model, plan, torch.device("cuda"), lr=1e-4, description=text)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    setup = time.perf_counter() - t0
    mem["peak_during_construction"] = torch.cuda.max_memory_allocated()
    mem["after_engine"] = torch.cuda.memory_allocated()  # static: the engine's buffers (no moments yet)
    mem["report_after_engine"] = eng.memory_report()
    g = torch.Generator(device="cuda").manual_seed(1 + dist_rank())  # each rank its own tokens
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda", generator=g)
    losses = []

    phase_peaks = []

    def mark(events):
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
            # the allocator's peak since the last mark (it counts at the host's call, in stream order)
            phase_peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def step(events=None):
        """One optimizer step; with `events`, CUDA events on the compute stream at each phase's
        start and end (forward and backward of every round, the optimizer step)."""
        for _ in range(rounds):
            mark(events)
            l = loss_of(model, ids) / rounds / world  # the ranks' grads sum to the global mean's
            mark(events)
            l.backward()
        mark(events)
        n, _ = eng.optimizer_step(1.0, True)
        mark(events)
        losses.append(float(n))

    torch.cuda.reset_peak_memory_stats()
    try:
        step()
        torch.cuda.synchronize()
        mem["after_first_step"] = torch.cuda.memory_allocated()  # static incl. the GPU units' moments
        mem["peak_first_step"] = torch.cuda.max_memory_allocated()
        step()  # warm-up; its CPU AdamW may still run into the window, as the last step's runs past it
        eng.reset_host_seconds()
        s = timed(step, 0, steps)
        # one more step, in the same steady state, timed phase by phase on the GPU's timeline (the
        # cost model's phase_s): forward, backward of each round, then the optimizer
        events = []
        peak_before = torch.cuda.max_memory_allocated()  # the phase marks reset the allocator's peak
        step(events)
        eng.synchronize()
        phases = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
        # the counters saw steps + 2 optimizer updates (the warm-up's ran after the reset, and the
        # phase-timed step's) and steps + 1 forwards and backwards
        updates = steps + 2
        host_s = {k: v / (updates if k in OPTIMIZER_KINDS else steps + 1) for k, v in eng.reset_host_seconds().items()}
    except BaseException:
        eng.close()  # the hooks off the model: the next section starts with this memory free
        raise
    peak = max([peak_before, torch.cuda.max_memory_allocated()] + phase_peaks)
    # the peak of each phase of the phase-timed step over the engine's static memory (forward incl.
    # the loss, backward of each round, optimizer), next to the prediction's peak over static
    mem["phase_peak_over_static"] = [p - mem["after_first_step"] for p in phase_peaks[1:]]
    mem.update(peak=peak, peak_reserved=torch.cuda.max_memory_reserved(), report=eng.memory_report())
    # transient = what a step adds on top of the engine's own buffers (activations, loss, grads in flight)
    mem["peak_over_static"] = peak - mem["after_first_step"]
    pr = plan.predicted
    out = {"step_s": s, "tokens_per_s": world * mb * seq * rounds / s, "world": world, "peak_gpu_bytes": peak,
           "gpu_cap_bytes": int(cap_gib * GiB),
           "setup_s": setup, "useful_tflops_per_gpu": pr["useful_tflops"] * pr["step_s"] / s,
           "useful_tflops": pr["useful_tflops"] * pr["step_s"] / s,
           "predicted_step_s": pr["step_s"], "predicted_peak_gpu_bytes": pr["peak_gpu_bytes"],
           "step_error": s / pr["step_s"] - 1, "peak_error": peak / pr["peak_gpu_bytes"] - 1,
           "grad_norms": losses, "block_calibration": cal, "memory": mem,
           # host time per step by kind (the CPU worker's and the training thread's waits), next to
           # the cost model's CPU time per step (optimizer, conversions, host norm; accumulation apart)
           "host_seconds_per_step": host_s, "optimizer_updates_timed": updates, "predicted_cpu_opt_s": pr.get("cpu_opt_s"),
           "measured_phase_s": phases, "predicted_phase_s": pr.get("phase_s"),
           "predicted_memory": {k: pr.get(k) for k in ("static_gpu_bytes", "activation_bytes", "transient_bytes")},
           "refit_fudge_over_block": s / pr["step_s"], "plan": {"layer_modes": plan.layer_modes, "layer_acts": plan.layer_acts,
                                          "outer": plan.outer_mode, "depth": plan.prefetch_depth,
                                          "micro_batch": mb, "rounds": rounds, "layer_gpu_acc": plan.layer_gpu_acc,
                                          "outer_gpu_acc": plan.outer_gpu_acc}, "plan_text": text}
    eng.close()
    del eng, model
    torch.cuda.empty_cache()
    return out


# (a): 3B at 8 micro-batches of 1x4096 tokens per optimizer step for all three rows (a realistic
# step: 32k tokens); (b): 8B, one 1x8192 micro-batch. Per-row wall caps (s): a row gets
# min(cap, what is left of --budget_s) and is killed past it, so the script fits one device call.
A_MB, A_SEQ = 1, 4096
ROWS = {
    "a_offload_16GiB": 130,
    "a_offload_16GiB_bf16_grads": 120,
    "a_resident": 60,
    "a_fsdp2_cpu_offload": 240,  # run 5: its warm-up step alone took 101.6 s on the H100
    "b_8B_bf16_24GiB": 130,
    "b_8B_bf16_24GiB_32k": 150,
    "m_8B_bf16_24GiB": 180,
    "o_8B_bf16_40GiB_32k": 240,  # + page-locking the activation arenas (tens of GB) in its first step
    "o_8B_bf16_40GiB_32k_no_act_offload": 150,
    "o_8B_bf16_40GiB_32k_recompute_only": 150,
}


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def run_row(name: str, args) -> dict:
    """One row, in this (child) process (every rank's process for section m rows)."""
    from flame.offload.planner.hardware import load

    prof = load(os.path.join(args.out, "profile.json"))
    LOSS_CHUNK["tokens"] = args.loss_chunk_tokens
    fp32, bf16 = Dtypes(), Dtypes("bfloat16", "bfloat16", "bfloat16", "bfloat16")
    r = args.a_rounds
    if name == "a_offload_16GiB":
        return run_engine(llama("3B"), prof, fp32, 16, A_SEQ, A_MB * r, args.steps, torch.float32)
    if name == "a_offload_16GiB_bf16_grads":
        # fp32 master and moments, bf16 gradients: every block's accumulator fits on the GPU
        return run_engine(llama("3B"), prof, Dtypes("bfloat16", "float32", "bfloat16", "float32"), 16, A_SEQ, A_MB * r,
                          args.steps, torch.float32)
    if name == "a_resident":
        return run_resident(llama("3B"), A_MB, A_SEQ, r, args.steps)
    if name == "a_fsdp2_cpu_offload":
        return run_fsdp2_offload(llama("3B"), A_MB, A_SEQ, r, 1)
    if name in ("b_8B_bf16_24GiB", "m_8B_bf16_24GiB"):
        # m: the same per-GPU work on every GPU of the machine (weak scaling against b)
        return run_engine(llama("8B"), prof, bf16, 24, 8192, 1, args.steps, torch.bfloat16)
    if name == "b_8B_bf16_24GiB_32k":
        # 4 x 8192 tokens per step: the CPU AdamW over 8B parameters is shared by 4x the compute
        return run_engine(llama("8B"), prof, bf16, 24, 8192, 4, args.steps, torch.bfloat16)
    if name.startswith("o_8B_bf16_40GiB_32k"):
        # o: a cap where the planner offloads some blocks' activations instead of recomputing them,
        # next to the same cap with that option off
        # and without selective recompute either (every block either keeps or recomputes all)
        return run_engine(llama("8B"), prof, bf16, 40, 8192, 4, args.steps, torch.bfloat16,
                          offload_activations=name == "o_8B_bf16_40GiB_32k",
                          selective_recompute=not name.endswith("_recompute_only"))
    raise ValueError(name)


PARTIAL = {"path": ""}


def _partial(d: dict) -> None:
    """Write what a row measured so far (read back by the parent if the row is killed)."""
    if PARTIAL["path"]:
        with open(PARTIAL["path"], "w") as f:
            json.dump({"partial": d}, f)


def child(args) -> None:
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if multi:  # section m under torchrun: one process per GPU, NCCL between them
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    PARTIAL["path"] = args.child_out if dist_rank() == 0 else ""
    t = time.perf_counter()
    try:
        out = run_row(args.child, args)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    out["wall_s"] = time.perf_counter() - t
    if dist_rank() == 0:
        with open(args.child_out, "w") as f:
            json.dump(out, f, indent=1)
    if multi:
        import torch.distributed as dist

        dist.destroy_process_group()


def spawn(name: str, args, timeout: float) -> dict:
    """Run one row in its own process: no memory one row leaves (or leaks) can OOM another."""
    import subprocess

    path = os.path.join(args.out, f"row_{name}.json")
    if os.path.exists(path):
        os.remove(path)
    launcher = [sys.executable]
    if name.startswith("m_"):  # every GPU of the machine, one process each
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={torch.cuda.device_count()}"]
    cmd = launcher + [os.path.abspath(__file__), args.out, "--child", name, "--child_out", path,
                      "--steps", str(args.steps), "--a_rounds", str(args.a_rounds),
                      "--loss_chunk_tokens", str(args.loss_chunk_tokens)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        out = {"skipped": f"killed after {timeout:.0f} s (time budget)"}
        if os.path.exists(path):
            with open(path) as f:
                out.update(json.load(f))
        return out
    if not os.path.exists(path):
        return {"error": f"row process exited {proc.returncode} without a result", "wall_s": time.perf_counter() - t}
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description="Offload benchmark: every row in its own process; "
                                 "writes OUT/offload.json and OUT/offload.md.")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--sections", default="a,b", help="a (3B: engine, resident, FSDP2 offload), b (8B bf16 engine), "
                    "m (b on every GPU of the machine, host state sharded over the ranks: weak scaling vs b), "
                    "o (8B at 40 GiB with and without activation offload)")
    ap.add_argument("--rows", default="", help="comma-separated row names to run (default: every row of --sections)")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per engine/resident row")
    ap.add_argument("--a_rounds", type=int, default=8, help="micro-batches of 1x4096 tokens per step in (a)")
    ap.add_argument("--loss_chunk_tokens", type=int, default=0,
                    help="every row: head + cross-entropy in chunks of this many tokens (training.loss_chunk_tokens); 0: plain")
    ap.add_argument("--budget_s", type=float, default=520, help="wall budget of the whole script (rows are capped)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child_out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        child(args)
        return
    t_start = time.perf_counter()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "a_tokens_per_step": A_MB * A_SEQ * args.a_rounds, "a_rounds": args.a_rounds,
           "loss_chunk_tokens": args.loss_chunk_tokens}
    path = os.path.join(args.out, "offload.json")

    def dump():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    t0 = time.perf_counter()
    prof = measure([(8192, 3072, 3072), (8192, 8192, 3072), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 8192, 8192)])
    res["profile_s"] = time.perf_counter() - t0
    save(prof, os.path.join(args.out, "profile.json"))
    res["profile"] = prof.__dict__
    torch.cuda.empty_cache()
    dump()
    ceiling = prof.gemm_rate("8192x8192x8192") / 1e12
    secs = args.sections.split(",")
    for name, cap in ROWS.items():
        if name[0] not in secs or (args.rows and name not in args.rows.split(",")):
            continue
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 30:
            res[name] = {"skipped": "time budget"}
        else:
            res[name] = spawn(name, args, min(cap, left))
        print(name, json.dumps({k: v for k, v in res[name].items() if k not in ("plan_text", "trace")})[:800], flush=True)
        dump()
    a, r, f = res.get("a_offload_16GiB", {}), res.get("a_resident", {}), res.get("a_fsdp2_cpu_offload", {})
    summ = {}
    if "tokens_per_s" in a and "tokens_per_s" in r:
        summ["a_offload_vs_resident"] = a["tokens_per_s"] / r["tokens_per_s"]
    if "tokens_per_s" in a and "tokens_per_s" in f:
        summ["a_offload_vs_fsdp2_offload"] = a["tokens_per_s"] / f["tokens_per_s"]
    a2 = res.get("a_offload_16GiB_bf16_grads", {})
    if "tokens_per_s" in a2 and "tokens_per_s" in r:
        summ["a_bf16_grads_vs_resident"] = a2["tokens_per_s"] / r["tokens_per_s"]
    if "tokens_per_s" in a2 and "tokens_per_s" in f:
        summ["a_bf16_grads_vs_fsdp2_offload"] = a2["tokens_per_s"] / f["tokens_per_s"]
    fw = f.get("partial", {}).get("warmup_step_s")
    if fw and "tokens_per_s" not in f:
        # killed FSDP2 row: its steady step is at most its warm-up step, so these ratios (ours over
        # FSDP2 at its warm-up speed) are upper bounds of the true ones
        for key, row in (("a_offload_vs_fsdp2_upper_bound", a), ("a_bf16_grads_vs_fsdp2_upper_bound", a2)):
            if "tokens_per_s" in row:
                summ[key] = row["tokens_per_s"] * fw / (A_MB * A_SEQ * args.a_rounds)
    b = res.get("b_8B_bf16_24GiB", {})
    if "useful_tflops" in b:
        summ["b_fraction_of_ceiling"] = b["useful_tflops"] / ceiling
    b32 = res.get("b_8B_bf16_24GiB_32k", {})
    if "useful_tflops" in b32:
        summ["b_32k_fraction_of_ceiling"] = b32["useful_tflops"] / ceiling
    o, o0 = res.get("o_8B_bf16_40GiB_32k", {}), res.get("o_8B_bf16_40GiB_32k_no_act_offload", {})
    if "tokens_per_s" in o and "tokens_per_s" in o0:
        summ["o_act_offload_vs_without"] = o["tokens_per_s"] / o0["tokens_per_s"]
    o1 = res.get("o_8B_bf16_40GiB_32k_recompute_only", {})
    if "tokens_per_s" in o0 and "tokens_per_s" in o1:
        summ["o_selective_vs_recompute_only"] = o0["tokens_per_s"] / o1["tokens_per_s"]
    m = res.get("m_8B_bf16_24GiB", {})
    if "tokens_per_s" in m and "tokens_per_s" in b:
        summ["m_gpus"] = m["world"]
        summ["m_weak_scaling_efficiency"] = m["tokens_per_s"] / (m["world"] * b["tokens_per_s"])
    summ["gemm_ceiling_tflops"] = ceiling
    res["summary"] = summ
    dump()
    rows = ["| run | tokens/s | step s | peak GPU GiB | engine static GiB | peak over static GiB | predicted step s | "
            "predicted peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for k in ROWS:
        v = res.get(k, {})
        if "step_s" in v:
            mem = v.get("memory", {})
            cells = [f"{v['tokens_per_s']:.0f}", f"{v['step_s']:.3f}", f"{v['peak_gpu_bytes'] / GiB:.2f}",
                     f"{mem['after_first_step'] / GiB:.2f}" if "after_first_step" in mem else "-",
                     f"{mem['peak_over_static'] / GiB:.2f}" if "peak_over_static" in mem else "-",
                     f"{v['predicted_step_s']:.3f}" if "predicted_step_s" in v else "-",
                     f"{v['predicted_peak_gpu_bytes'] / GiB:.2f}" if "predicted_peak_gpu_bytes" in v else "-"]
            rows.append(f"| {k} | " + " | ".join(cells) + " |")
        else:
            rows.append(f"| {k} | {v.get('error', v.get('skipped', 'not run'))[:120]} | | | | | | |")
    rows.append("")
    rows.append(f"(a): {args.a_rounds} x {A_MB}x{A_SEQ} tokens per optimizer step in every row; each row in its own process")
    rows.append("summary: " + json.dumps(summ))
    with open(os.path.join(args.out, "offload.md"), "w") as f:
        f.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
