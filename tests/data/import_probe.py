"""Imported by tests.data.fork_server_probe: appends the importing process's PID to $FLAME_IMPORT_PROBE."""

import os

with open(os.environ["FLAME_IMPORT_PROBE"], "a") as f:
    f.write(f"{os.getpid()}\n")
