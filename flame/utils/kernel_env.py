"""flame's environment variables that pick kernels: read and checked in one place, so train.sh's
check before the launch reports a bad value the same way the kernels would."""
from __future__ import annotations

import os

from flame.errors import ConfigError

# name: (accepted values, or int for a whole number >= 0; default)
KERNEL_ENV = {
    # softmax attention over documents (cu_seqlens) on GPU: torch's varlen_attn where it applies, or
    # FlexAttention with a document mask always
    "FLAME_VARLEN_SOFTMAX": (("varlen", "flex"), "varlen"),
    # flame's attention tiles: 1 times uncached shapes once per machine, 0 never times, force times again
    "FLAME_ATTN_AUTOTUNE": (("0", "1", "force"), "1"),
    # at most this many configs per Triton-autotuned kernel (flame.utils.autotune); 0: all
    "FLAME_AUTOTUNE_MAX_CONFIGS": (int, "0"),
}


def kernel_env(name: str) -> str:
    """The value of `name` (a key of KERNEL_ENV), its default when unset or empty."""
    choices, default = KERNEL_ENV[name]
    value = (os.environ.get(name) or "").strip() or default
    if choices is int:
        if not value.isdigit():
            raise ConfigError(f"{name}={value!r}: expected a whole number >= 0")
    elif value not in choices:
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(choices)}")
    return value


def check_kernel_env() -> None:
    for name in KERNEL_ENV:
        kernel_env(name)
