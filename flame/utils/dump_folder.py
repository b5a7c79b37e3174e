"""Print the dump folder a train.sh command line resolves to (CLI > TOML > default).

train.sh needs it for per-rank logs before torchrun starts; parsing the whole config here
also rejects bad options before any process is spawned.
"""

import sys

from flame.config.manager import FlameConfigManager
from flame.errors import ConfigError


def main(argv: list[str]) -> int:
    try:
        cfg = FlameConfigManager().parse_args(argv)
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    print(cfg.job.dump_folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
