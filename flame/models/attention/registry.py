"""Names of attention backends -> what they compute (row function, scaling) and how (implementation)."""
from __future__ import annotations

from dataclasses import dataclass

from flame.errors import ConfigError

ROWS = ("softmax", "softpick", "rectified")
IMPLS = ("sdpa", "flex", "fla", "triton", "naive")


@dataclass(frozen=True)
class AttentionBackend:
    """One selectable backend.

    rows:   which row normalisation: softmax | softpick | rectified
    impl:   sdpa (torch SDPA; varlen via torch varlen_attn/FlexAttention on GPU, dense document
            mask on CPU) | flex (FlexAttention on GPU) | fla (fla.ops.attn.parallel_attn on GPU) |
            triton (flame.ops kernels on GPU) | naive (pure torch, returns weights)
    scaled: multiply queries by a learnable per-head scale times log(position + 2)
    """

    name: str
    rows: str
    impl: str
    scaled: bool = False

    @property
    def needs_kernel_head_dim(self) -> bool:
        return self.impl in ("triton", "fla")


def _table() -> dict[str, AttentionBackend]:
    t: dict[str, AttentionBackend] = {}

    def add(name, rows, impl, scaled=False):
        t[name] = AttentionBackend(name, rows, impl, scaled)

    # flame-native names
    add("sdpa", "softmax", "sdpa")
    add("flex", "softmax", "flex")
    add("fla", "softmax", "fla")
    add("fla_parallel", "softmax", "fla")
    add("triton", "softmax", "triton")
    add("naive", "softmax", "naive")
    add("scaled", "softmax", "sdpa", True)
    add("scaled_sdpa", "softmax", "sdpa", True)
    for rows in ("softpick", "rectified"):
        add(rows, rows, "triton")
        add(f"scaled_{rows}", rows, "triton", True)
        add(f"naive_{rows}", rows, "naive")
        add(f"naive_scaled_{rows}", rows, "naive", True)
    # names of the softpick paper's configs (`attn_impl`)
    for prefix, impl in (("parallel", "triton"), ("naive", "naive")):
        add(f"{prefix}_attn", "softmax", impl)
        add(f"{prefix}_softpick_attn", "softpick", impl)
        add(f"{prefix}_rectified_attn", "rectified", impl)
        add(f"{prefix}_scaled_attn", "softmax", impl, True)
        add(f"{prefix}_scaled_softpick_attn", "softpick", impl, True)
        add(f"{prefix}_scaled_rectified_attn", "rectified", impl, True)
    return t


BACKENDS: dict[str, AttentionBackend] = _table()


def get_backend(name) -> AttentionBackend:
    if isinstance(name, AttentionBackend):
        return name
    if not isinstance(name, str) or name not in BACKENDS:
        raise ConfigError(f"unknown attn_impl {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def resolve_layer_backends(attn_impl, num_layers: int) -> list[AttentionBackend]:
    """``attn_impl`` is one name for all layers or a list with one name per layer."""
    if isinstance(attn_impl, (list, tuple)):
        if len(attn_impl) != num_layers:
            raise ConfigError(f"attn_impl lists {len(attn_impl)} names for {num_layers} layers")
        return [get_backend(n) for n in attn_impl]
    return [get_backend(attn_impl)] * num_layers
