"""`python -m flame.offload.profile OUT.json`: measure this machine's hardware profile
(flame.offload.measure.hardware)."""

import sys

from flame.offload.measure.hardware import main

if __name__ == "__main__":
    sys.exit(main())
