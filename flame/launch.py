"""flame's job launcher, what ``bash train.sh`` runs: ``python flame/launch.py [--section.key value ...]``.

It runs as a script with the standard library only (no torch in a process that lives as long
as the job) and wraps torchrun:

- the default tiny job is the base of every command line without ``--job.config_file``, so
  ``bash train.sh --training.steps 20`` is the default job with 20 steps;
- the config is parsed and checked once before any process starts (``flame.utils.dump_folder``);
- one trainer per dump folder: node 0 holds ``DUMP/.flame.lock`` for the life of the job;
- single-node jobs rendezvous on a free port (torchrun ``--standalone``) unless ``MASTER_PORT`` is set;
- torchrun dies with the launcher and the workers die with torchrun (parent-death signals),
  so ``kill -9`` of the launcher leaves nothing running;
- SIGTERM/SIGINT go to the workers, which finish the step, save and exit; a second one ends
  the job at once;
- SIGUSR1 goes to the workers, which print every thread's stack to their log (a job that
  hangs shows where) and go on;
- the console gets the workers' output and, when the job fails, one line saying why (the
  worker's ``flame: error: ...``) instead of torchrun's failure report; every log stays under
  ``DUMP/logs``.

Environment: NGPU, NNODE, NODE_RANK, MASTER_ADDR, MASTER_PORT, LOG_RANK, PYTHON (see README),
FLAME_SHUTDOWN_TIMEOUT (seconds torchrun waits for workers to exit after a signal, default 120).
"""

import glob
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

LAUNCH_TIME = time.time()  # the run summary's wall time counts from here
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# The config check before any process starts (flame.utils.dump_folder). Parsing needs flame's config
# modules only; the package's __init__ registers every model family with transformers, which
# imports FLA and its Triton kernels (seconds, before every launch), so the check runs under a bare
# `flame` package object instead.
CONFIG_CHECK = (
    "import sys, types\n"
    f"package = types.ModuleType('flame'); package.__path__ = [{HERE!r}]; sys.modules['flame'] = package\n"
    "from flame.utils.dump_folder import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _load_run_lock():
    # by path: importing the flame package would import torch and FLA into the launcher
    spec = importlib.util.spec_from_file_location("_flame_run_lock", os.path.join(HERE, "utils", "run_lock.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_job(root: str = ROOT) -> list[str]:
    """The quick-start job: a tiny transformer on the bundled corpus and tokenizer (CPU-friendly)."""
    return [
        "--job.config_file", os.path.join(root, "flame/models/fla.toml"),
        "--job.dump_folder", "exp/default-tiny",
        "--model.config", os.path.join(root, "configs/debug/transformer_tiny.json"),
        "--model.tokenizer_path", os.path.join(root, "flame/assets/tokenizer"),
        "--training.dataset", os.path.join(root, "flame/assets/sample_corpus"),
        # context_len as seq_len: varlen (`--training.varlen`) needs context_len <= seq_len
        "--training.batch_size", "8", "--training.seq_len", "256", "--training.context_len", "256",
        "--training.steps", "120",
        "--training.num_workers", "0", "--training.mixed_precision_param", "float32",
        "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "20", "--lr_scheduler.decay_type", "cosine",
        "--checkpoint.interval", "50", "--checkpoint.keep_latest_k", "1", "--metrics.log_freq", "10",
    ]


def job_args(user_args: list[str]) -> list[str]:
    """The user's options on top of the default job; a user TOML replaces the default job whole."""
    keys = {"--" + a[2:].split("=", 1)[0].replace("-", "_") for a in user_args if a.startswith("--")}
    if "--job.config_file" in keys:
        return list(user_args)
    base = default_job()
    if "--model.init_from" in keys:
        # the model and its tokenizer come from the init_from folder (flame.components.init_from)
        for option in ("--model.config", "--model.tokenizer_path"):
            i = base.index(option)
            del base[i:i + 2]
    return base + list(user_args)


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (torchrun's workers)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _die_with_parent():
    # runs in torchrun's process between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _write(path: str, lines: list[str]) -> None:
    try:
        with open(path, "a") as f:
            f.writelines(lines)
    except OSError:
        pass  # a full disk: the console still gets the explanation


class Job:
    def __init__(self, args: list[str], python: str, env: dict):
        self.args, self.python, self.env = args, python, env
        self.proc = None
        self.signum = 0
        self.withheld: list[str] = []  # rank 0's final "flame: ..." line, printed by us instead
        self.torchrun_lines: list[str] = []

    # -- signals ---------------------------------------------------------------------------
    def on_signal(self, signum, frame):
        if self.proc is None:  # nothing started yet
            print(f"flame: stopped by {signal.Signals(signum).name} before training started", file=sys.stderr)
            raise SystemExit(128 + signum)
        if self.signum:
            self.proc.kill()  # a second signal: torchrun's death takes the workers with it
            return
        self.signum = signum
        # straight to the workers: torchrun would SIGKILL them after its shutdown timeout
        if not self._signal_workers(signum):
            self.proc.send_signal(signum)

    def on_stack_request(self, signum, frame):
        # the workers print their stacks (each is in a session of its own: a group signal misses them)
        if self.proc is not None:
            self._signal_workers(signum)

    def _signal_workers(self, signum) -> list[int]:
        """Send `signum` to torchrun's children (the workers); returns their PIDs."""
        workers = _children(self.proc.pid)
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return workers

    # -- the run ---------------------------------------------------------------------------
    def run(self, cmd: list[str], log_dir: str) -> int:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        own = []
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("[rank"):
                content = line.split("]:", 1)[-1]
                if content.startswith(("flame: error:", "flame: stopped", "flame: crashed")):
                    self.withheld.append(content.rstrip("\n"))
                    continue
                sys.stdout.write(line)
                sys.stdout.flush()
            else:  # torchrun's own messages: to the log, and to the console only when they explain a failure
                own.append(line)
                self.torchrun_lines.append(line)
                if len(own) >= 50:
                    _write(os.path.join(log_dir, "torchrun.log"), own)
                    own = []
                del self.torchrun_lines[:-400]
        _write(os.path.join(log_dir, "torchrun.log"), own)
        return self.proc.wait()


def explain(rc: int, records: list[dict], job: Job, rdzv: str) -> tuple[int, str]:
    """The exit code and the stderr text of a finished job."""
    by_kind = {}
    for r in sorted(records, key=lambda r: (r.get("rank", 0), r.get("time", 0))):
        by_kind.setdefault(r.get("kind"), []).append(r)
    for kind in ("error", "nonfinite", "stopped"):
        if kind in by_kind:
            r = by_kind[kind][0]
            return int(r["code"]), r["line"]
    if "crash" in by_kind:
        r = min(by_kind["crash"], key=lambda r: r.get("time", 0))
        tail = "".join(r.get("traceback", "").splitlines(keepends=True)[-15:])
        where = os.path.join(r["log_dir"], "stderr.log") if r.get("log_dir") else "DUMP/logs"
        return 1, f"{tail}{r['line']}\nfull log: {where}"
    if rc == 0:
        return 0, ""
    if job.withheld:
        line = job.withheld[0]
        return (2 if line.startswith("flame: error:") else 3 if "non-finite" in line else rc), line
    if job.signum:
        return 128 + job.signum, f"flame: stopped by {signal.Signals(job.signum).name} before training started"
    text = "".join(job.torchrun_lines)
    if not any("local_rank" in l and "exitcode" in l for l in job.torchrun_lines) and any(
            k in text for k in ("Rendezvous", "DistNetworkError", "EADDRINUSE", "address already in use",
                                "Connection refused", "TimeoutError")):
        reason = next((l.strip() for l in reversed(job.torchrun_lines)
                       if "Error" in l and ":" in l and not l.startswith(" ")), "see DUMP/logs/torchrun.log")
        name, _, message = reason.partition(": ")  # drop the module path and the hint to read on
        reason = f"{name.rsplit('.', 1)[-1]}: {message.split('. ')[0]}" if message else reason
        return 2, (f"flame: error: rendezvous at {rdzv} failed ({reason[:200]}); is another program on that port? "
                   "(a single-node job without MASTER_PORT takes a free port)")
    killed = [l for l in job.torchrun_lines if "exitcode: -" in l]
    if killed:
        sig = killed[0].split("exitcode: -", 1)[1].split(")")[0]
        try:
            name = signal.Signals(int(sig)).name
        except ValueError:
            name = f"signal {sig}"
        # the kernel's OOM killer sends SIGKILL; with offload the host budget is the lever
        hint = (" (out of host memory? under offload, a smaller --offload.host_memory_gib leaves more of it to "
                "the rest of the machine)") if name == "SIGKILL" else ""
        return 1, f"flame: crashed: a worker was killed by {name}{hint}; torchrun's log: DUMP/logs/torchrun.log"
    return rc, "".join(job.torchrun_lines[-20:]) + f"flame: crashed: torchrun exited with {rc}; logs under DUMP/logs"


def _shutdown_timeout_args() -> list[str]:
    """torchrun's ``--shutdown_timeout`` (seconds workers get after a signal) where this torch has it
    (torch 2.11's torchrun does not; it then uses its own fixed grace period)."""
    spec = importlib.util.find_spec("torch")
    run_py = os.path.join(os.path.dirname(spec.origin), "distributed", "run.py") if spec and spec.origin else ""
    try:
        with open(run_py) as f:
            text = f.read()
        supported = "--shutdown_timeout" in text or "--shutdown-timeout" in text
    except OSError:
        supported = False
    return ["--shutdown_timeout", (os.environ.get("FLAME_SHUTDOWN_TIMEOUT") or "120")] if supported else []


def _remove_orphaned_outcome_dirs(parent: str) -> None:
    """The outcome folders of launchers that are gone (killed with -9: nothing removed them)."""
    for path in glob.glob(os.path.join(parent, "flame-outcome-*-*")):
        pid = os.path.basename(path).split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # another user's live launcher
            pass


def environment_error(environ) -> str | None:
    """The first launcher environment variable a user set to a value torchrun cannot take, as one
    ``flame: error:`` line; None when all are usable."""
    def whole_number_error(name, least):
        v = environ.get(name)
        if v is not None and v != "" and not (v.isdigit() and int(v) >= least):
            return f"flame: error: {name}={v!r}: expected a whole number >= {least}"
        return None

    for name, least in (("NGPU", 1), ("NNODE", 1), ("NODE_RANK", 0), ("MASTER_PORT", 1), ("FLAME_SHUTDOWN_TIMEOUT", 0)):
        problem = whole_number_error(name, least)
        if problem:
            return problem
    port = environ.get("MASTER_PORT")
    if port and int(port) > 65535:
        return f"flame: error: MASTER_PORT={port!r}: a port is at most 65535"
    nnode, node_rank = environ.get("NNODE") or "1", environ.get("NODE_RANK") or "0"
    if int(node_rank) >= int(nnode):
        return f"flame: error: NODE_RANK={node_rank!r}: must be below NNODE={nnode}"
    ranks = environ.get("LOG_RANK")
    if ranks and not all(r.strip().isdigit() for r in ranks.split(",")):
        return f"flame: error: LOG_RANK={ranks!r}: expected rank numbers separated by commas, e.g. 0 or 0,1"
    python = environ.get("PYTHON")
    if python and not shutil.which(python):
        return f"flame: error: PYTHON={python!r}: no such executable"
    return None


def log_rank_error(ranks: str | None, nproc_per_node: int) -> str | None:
    """``LOG_RANK`` naming a local rank the job does not have (the console would stay silent)."""
    if not ranks:
        return None
    beyond = [r.strip() for r in ranks.split(",") if int(r) >= nproc_per_node]
    if beyond:
        return (f"flame: error: LOG_RANK={ranks!r}: no local rank {beyond[0]}; this job runs {nproc_per_node} "
                f"process(es) a node (ranks 0-{nproc_per_node - 1})")
    return None


def main(argv: list[str]) -> int:
    problem = environment_error(os.environ)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    python = os.environ.get("PYTHON") or sys.executable
    env = dict(os.environ)
    # the working directory too: the config check before the launch imports model.module from it
    # (as `python -m` would), so the workers, started from a script path, must find it there as well
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.getcwd(), env.get("PYTHONPATH")) if p)
    if any(a in ("-h", "--help") for a in argv):
        # the help shows the values this run would use: the default job's options (or the job file
        # the user names) with the user's on top
        os.execvpe(python, [python, "-m", "flame.train", *job_args(argv)], env)
    args = job_args(argv)
    job = Job(args, python, env)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, job.on_signal)
    signal.signal(signal.SIGUSR1, job.on_stack_request)

    # parse and check the whole config once, before any process is spawned
    resolve = subprocess.Popen([python, "-c", CONFIG_CHECK, *args], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ngpu = os.environ.get("NGPU")
    if not ngpu:
        ngpu = subprocess.run([python, "-c", "import torch; print(max(torch.cuda.device_count(), 1))"],
                              env=env, capture_output=True, text=True).stdout.strip() or "1"
    out, err = resolve.communicate()
    rc = resolve.returncode
    if rc != 0:
        lines = [l for l in err.splitlines() if l.startswith("flame: error:")]
        missing = [l for l in err.splitlines() if l.startswith(("ModuleNotFoundError:", "ImportError:"))]
        if not lines and missing:
            # the interpreter, not the job: one line that says which and what to do
            lines = [f"flame: error: {python} cannot import flame's dependencies ({missing[-1]}); run train.sh "
                     "in the environment flame is installed in (pip install -e .) or set PYTHON to its python"]
            rc = 2
        sys.stderr.write((lines[-1] + "\n") if lines else err)
        return rc
    problem = log_rank_error(os.environ.get("LOG_RANK"), int(ngpu))
    if problem:
        print(problem, file=sys.stderr)
        return 2
    dump = out.strip().splitlines()[-1]
    nnode = os.environ.get("NNODE", "1")
    node_rank = os.environ.get("NODE_RANK", "0")
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT")

    run_lock = _load_run_lock()
    lock_fd = None
    if node_rank == "0":  # the dump folder may be shared by all nodes: one holder
        try:
            lock_fd = run_lock.acquire(dump)
        except run_lock.DumpFolderInUse as e:
            print(f"flame: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"flame: error: job.dump_folder {dump!r}: not writable ({e.strerror})", file=sys.stderr)
            return 2
        if lock_fd is None:
            print(f"flame: warning: {dump}: the file system has no flock; two runs on this folder are not "
                  "prevented", file=sys.stderr)
    # the trainer takes no lock of its own: node 0's launcher holds it (global rank 0 may sit on any node)
    env[run_lock.ENV] = os.path.realpath(dump)
    log_dir = os.path.join(dump, "logs")
    try:
        os.makedirs(log_dir, exist_ok=True)
        git = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet"], capture_output=True).returncode != 0
        with open(os.path.join(dump, "run_info.txt"), "w") as f:
            f.write(f"date: {subprocess.run(['date', '-u', '+%Y-%m-%dT%H:%M:%SZ'], capture_output=True, text=True).stdout}"
                    f"command: bash train.sh {' '.join(argv)}\n"
                    f"flame: {git or 'unknown'}{' (modified)' if git and dirty else ''}\n"
                    f"NGPU={ngpu} NNODE={nnode} host={socket.gethostname()}\n")
    except OSError as e:
        print(f"flame: error: cannot write to {dump}: {e.strerror}", file=sys.stderr)
        return 2

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # RAM: a full disk cannot hide the outcome
    _remove_orphaned_outcome_dirs(shm or tempfile.gettempdir())
    outcome_dir = tempfile.mkdtemp(prefix=f"flame-outcome-{os.getpid()}-", dir=shm)
    env.update(FLAME_OUTCOME_DIR=outcome_dir, FLAME_LAUNCHER_PID=str(os.getpid()), FLAME_LAUNCH_TIME=str(LAUNCH_TIME))
    # torchrun gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is set; torchtitan then
    # sets 3 (what its flight recorder needs) with a warning on every run. The worker drops
    # torchrun's default (launch_worker.py); a value the user set stays, and so does the warning
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env:
        env["FLAME_DROP_TORCHRUN_NCCL_DEFAULT"] = "1"
    if nnode == "1" and not port:
        rdzv_args, rdzv = ["--standalone"], "a free local port (torchrun --standalone)"
    else:
        port = port or "29500"
        rdzv_args = ["--node_rank", node_rank, "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{port}"]
        rdzv = f"MASTER_ADDR={addr} MASTER_PORT={port}"
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", nnode, "--nproc_per_node", ngpu, *rdzv_args,
           "--local-ranks-filter", os.environ.get("LOG_RANK", "0"), "--role", "rank", "--tee", "3",
           "--log_dir", log_dir, *_shutdown_timeout_args(),
           os.path.join(HERE, "launch_worker.py"), *args]
    try:
        rc = job.run(cmd, log_dir)
        records = []
        for path in sorted(glob.glob(os.path.join(outcome_dir, "rank*.json"))):
            try:
                with open(path) as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                pass
    finally:
        shutil.rmtree(outcome_dir, ignore_errors=True)
    code, text = explain(rc, records, job, rdzv)
    if text:
        print(text.replace("DUMP/", dump.rstrip("/") + "/"), file=sys.stderr)
    if lock_fd is not None:
        os.close(lock_fd)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
