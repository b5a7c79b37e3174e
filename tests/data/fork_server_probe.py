"""Run as `python -m tests.data.fork_server_probe OUT.json` (a module, as torchrun runs the
trainer): three loader workers from flame's fork server; OUT.json gets this process's PID, the
workers' PIDs and every PID that imported tests.data.import_probe (a stand-in for the trainer's
imports: $FLAME_IMPORT_PROBE names the file each importer appends its PID to)."""

import json
import os
import sys

import torch.utils.data

import tests.data.import_probe  # noqa: F401  (records the importing process)
from flame.data.loader import workers_from_a_fork_server


class WorkerPids(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield os.getpid()


if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(WorkerPids(), batch_size=None, num_workers=3)
    workers_from_a_fork_server([loader, None])
    workers = [int(pid) for pid in loader]
    with open(os.environ["FLAME_IMPORT_PROBE"]) as f:
        importers = [int(line) for line in f]
    with open(sys.argv[1], "w") as f:
        json.dump({"main": os.getpid(), "workers": workers, "importers": importers}, f)
