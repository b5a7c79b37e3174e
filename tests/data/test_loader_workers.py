"""Loader workers started from flame's fork server (the trainer's model state in host memory)."""

import json
import os
import subprocess
import sys

from tests.trainer.helpers import ROOT


def test_fork_server_workers_reuse_the_servers_imports(tmp_path):
    """The trainer runs as a module; its workers come from a fork server that imported the
    trainer's module once: no worker imports it again (before, each of them imported flame,
    torch and FLA before its first batch)."""
    probe, out = tmp_path / "importers.txt", tmp_path / "out.json"
    env = dict(os.environ, FLAME_IMPORT_PROBE=str(probe), PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-m", "tests.data.fork_server_probe", str(out)], env=env, cwd=ROOT,
                   check=True, timeout=300)
    got = json.loads(out.read_text())
    workers, importers = set(got["workers"]), got["importers"]
    assert len(workers) == 3 and got["main"] not in workers
    # the probe process itself and the fork server, once each; never a worker
    assert len(importers) == 2 and got["main"] in importers, got
    assert not workers & set(importers), got
