"""flame's per-user cache folders on disk."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str, env: str) -> Path:
    """`$env` when set, else `$XDG_CACHE_HOME/flame/<name>` (`~/.cache/flame/<name>`)."""
    override = os.environ.get(env)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flame" / name
