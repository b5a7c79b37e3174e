"""`kill -USR1` on a worker prints its threads' stacks, also while a library has pointed
descriptor 2 elsewhere (as compilers' output captures do)."""

import subprocess
import sys
import textwrap

from tests.trainer.helpers import ROOT

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from flame.train import _print_stacks_on_sigusr1

    def in_a_captured_stretch():
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)  # descriptor 2 points at /dev/null for a while
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.2)
        finally:
            os.dup2(saved, 2)

    _print_stacks_on_sigusr1()
    in_a_captured_stretch()
    print("went on", flush=True)
""")


def test_sigusr1_prints_the_stacks_to_stderr_while_descriptor_2_points_elsewhere():
    r = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "went on", r.stderr[-2000:]
    assert "(most recent call first):" in r.stderr and "in_a_captured_stretch" in r.stderr, r.stderr[-2000:]
