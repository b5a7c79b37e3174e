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


def test_a_packages_main_module_is_not_preloaded(monkeypatch):
    """`python -m pkg` runs pkg.__main__, often with no `__name__` guard: the fork server must not
    import it again (it would run the program); a module run by name is preloaded."""
    import multiprocessing.forkserver
    import types
    from importlib.machinery import ModuleSpec

    import torch.utils.data

    from flame.data.loader import workers_from_a_fork_server

    loader = torch.utils.data.DataLoader(list(range(4)), num_workers=1)
    preload = {}
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(multiprocessing.forkserver, "set_forkserver_preload", lambda names: preload.update(n=names))
    for spec, want in ((ModuleSpec("pkg.__main__", None), "__main__"), (ModuleSpec("flame.train", None), "flame.train"),
                       (None, "__main__")):
        main = types.ModuleType("__main__")
        main.__spec__ = spec
        monkeypatch.setitem(sys.modules, "__main__", main)
        workers_from_a_fork_server([loader])
        assert preload["n"] == [want, "datasets"]
