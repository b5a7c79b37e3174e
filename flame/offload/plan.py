"""`python -m flame.offload.plan ...`: the resource calculator's command (flame.offload.calculator)."""

import sys

from flame.offload.calculator import main

if __name__ == "__main__":
    sys.exit(main())
