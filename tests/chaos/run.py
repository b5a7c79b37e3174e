"""Kill/relaunch chaos on the tiny job (not part of pytest): ``python tests/chaos/run.py --n 20``.

For each rank count, one uninterrupted reference run, then a run that is interrupted ``n`` times at
random points (a random step, or a random time after launch, which also lands in start-up and in
checkpoint writes) by ``kill -9`` of the launcher's process group or, now and then, SIGTERM, and
relaunched with the same command each time until it finishes. Checked after every interruption:
no process of the job survives 10 s after a kill -9, SIGTERM exits 143 with one line (or 0 when it
came after the last step). Checked at the
end: every loss record of the interrupted run (replayed steps included) equals the reference's loss
at that step, and every step 1..steps was logged.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_SH = os.path.join(ROOT, "train.sh")


def job(dump: str, steps: int, interval: int) -> list[str]:
    return ["bash", TRAIN_SH, "--job.dump_folder", dump, "--training.steps", str(steps),
            "--training.batch_size", "2", "--training.seq_len", "64", "--metrics.log_freq", "1",
            "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k", "2",
            "--lr_scheduler.warmup_steps", "4", "--checkpoint.no-export-hf"]


def env(ranks: int) -> dict:
    e = dict(os.environ, NGPU=str(ranks), OMP_NUM_THREADS="1", PYTHON=sys.executable)
    e.pop("MASTER_PORT", None)
    return e


def records(dump: str) -> list[dict]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut by kill -9
            if "loss" in r:
                out.append(r)
    return out


def survivors(dump: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if dump.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def interrupted_run(dump, ranks, steps, interval, kills, rng, log):
    cmd = job(dump, steps, interval)
    problems, done, launches = [], 0, 0
    while True:
        launches += 1
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=env(ranks), start_new_session=True)
        if done >= kills:  # the last launch runs to the end
            _, err = proc.communicate()
            if proc.returncode != 0:
                problems.append(f"final launch exited {proc.returncode}: {err.strip()[-500:]}")
            return problems, launches
        start_step = max((r["step"] for r in records(dump)), default=0)
        if rng.random() < 0.5:
            target = rng.randint(min(start_step + 1, steps), steps)
            how = f"at step {target}"
            while proc.poll() is None and max((r["step"] for r in records(dump)), default=0) < target:
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 0.5))
        else:
            delay = rng.uniform(2, 40)
            how = f"{delay:.1f}s after launch"
            t0 = time.time()
            while proc.poll() is None and time.time() - t0 < delay:
                time.sleep(0.05)
        if proc.poll() is not None:  # finished before the kill point
            if proc.returncode != 0:
                problems.append(f"launch {launches} exited {proc.returncode}: {proc.stderr.read().strip()[-500:]}")
            done += 1
            log(f"  {ranks} rank(s) launch {launches}: finished before the kill point ({how})")
            if max((r["step"] for r in records(dump)), default=0) >= steps:
                return problems, launches
            continue
        sig = signal.SIGTERM if rng.random() < 0.25 else signal.SIGKILL
        reached = max((r["step"] for r in records(dump)), default=0)
        os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait()
            t0 = time.time()
            while survivors(dump) and time.time() - t0 < 10:
                time.sleep(0.1)
            left = survivors(dump)
            if left:
                problems.append(f"launch {launches}: processes {left} alive 10 s after kill -9")
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
            note = "no survivors" if not left else f"SURVIVORS {left}"
        else:
            _, err = proc.communicate(timeout=600)
            lines = err.strip().splitlines()
            finished = proc.returncode == 0 and not lines and max(r["step"] for r in records(dump)) >= steps
            ok = finished or (proc.returncode == 143 and len(lines) == 1 and lines[0].startswith("flame: stopped"))
            if not ok:
                problems.append(f"launch {launches}: SIGTERM gave exit {proc.returncode}: {err.strip()[-500:]}")
            note = f"exit {proc.returncode}: {lines[-1] if lines else ''}"
        done += 1
        log(f"  {ranks} rank(s) launch {launches}: {sig.name} {how} (logged step {reached}) -> {note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20, help="interruptions in total, split over the rank counts")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the dump folders")
    a = p.parse_args()
    rng = random.Random(a.seed)
    ranks = [int(r) for r in a.ranks.split(",")]
    base = tempfile.mkdtemp(prefix="flame-chaos-")
    log = lambda s: print(s, flush=True)  # noqa: E731
    summary, failed = [], False
    for i, n_ranks in enumerate(ranks):
        kills = a.n // len(ranks) + (1 if i < a.n % len(ranks) else 0)
        ref, dump = os.path.join(base, f"ref{n_ranks}"), os.path.join(base, f"chaos{n_ranks}")
        t0 = time.time()
        ref_proc = subprocess.run(job(ref, a.steps, a.interval), capture_output=True, text=True, env=env(n_ranks))
        if ref_proc.returncode != 0:
            log(f"reference run with {n_ranks} rank(s) failed: {ref_proc.stderr[-2000:]}")
            return 1
        want = {r["step"]: r["loss"] for r in records(ref)}
        log(f"{n_ranks} rank(s): reference {len(want)} steps in {time.time() - t0:.0f}s; {kills} interruptions")
        problems, launches = interrupted_run(dump, n_ranks, a.steps, a.interval, kills, rng, log)
        got = records(dump)
        mismatched = [(r["step"], r["loss"], want.get(r["step"])) for r in got if r["loss"] != want.get(r["step"])]
        missing = sorted(set(range(1, a.steps + 1)) - {r["step"] for r in got})
        replayed = len(got) - len({r["step"] for r in got})
        if mismatched:
            problems.append(f"{len(mismatched)} loss records differ from the reference, first: {mismatched[:3]}")
        if missing:
            problems.append(f"steps never logged: {missing}")
        failed |= bool(problems)
        summary.append(f"{n_ranks} rank(s): {kills} interruptions, {launches} launches, {len(got)} loss records "
                       f"({replayed} replayed steps), all equal to the uninterrupted run: {not mismatched}, "
                       f"{'OK' if not problems else 'FAILED: ' + '; '.join(problems)}")
    log("summary:")
    for s in summary:
        log("  " + s)
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        log(f"dump folders kept under {base}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
