"""Hardware profile: the rates the cost model needs, stored as JSON.

`flame.offload.measure.hardware.measure()` takes them on a CUDA device; on a machine without a
GPU the planner loads a stored profile (`load()`). Nothing here invents numbers: every field
comes from a measurement, and `source` says where and when it was taken.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from flame.errors import ConfigError

GiB = 1024**3


@dataclass
class HardwareProfile:
    source: str
    """Where the numbers come from (device name, host, date), for the printed plan."""
    device_name: str
    gpu_total_bytes: int
    host_total_bytes: int
    cpu_cores: int
    gemm_tflops: dict[str, float]
    """bf16 TFLOP/s per GEMM shape 'MxNxK' (the model's real shapes when measured for a model),
    plus key 'default' (the mean over measured shapes)."""
    attn_tflops: float
    """Causal attention fwd+bwd TFLOP/s (useful FLOPs, i.e. counting half the dense score matrix)."""
    hbm_gbps: float
    """Device memory copy rate (read+write bytes / s), for memory-bound elementwise work."""
    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    """Total rate when H2D and D2H run at the same time (both directions summed)."""
    pageable_h2d_gbps: float
    host_memcpy_gbps: float
    cpu_adam_gparams: dict[str, float]
    """Fused CPU AdamW rate (G params/s, fp32 states) per thread count (keys are str(threads))."""
    gpu_adam_gparams: float
    pin_s_per_gib: float
    """Seconds to page-lock one GiB of host memory."""
    allgather_gbps: float = 0.0
    reducescatter_gbps: float = 0.0
    extra: dict = field(default_factory=dict)
    cpu_adam_bf16_gparams: dict[str, float] = field(default_factory=dict)
    """Fused CPU AdamW rate with bf16 params, grads and moments (half the bytes of fp32), per
    thread count; empty in profiles stored before it was measured (the fp32 rate is used then)."""
    cpu_adam_one_pass: bool = False
    """The CPU AdamW rates were measured with flame's one-pass kernel (`flame.ops.cpu_adamw`: bf16
    grads read and the bf16 compute copy written in the same pass), as the engine runs it when the
    kernel builds; False in profiles measured with torch's fused AdamW, whose grad conversion and
    compute copy are separate passes."""
    cpu_adam_out_of_place_slowdown: float = 1.0
    """How many times longer flame's one-pass kernel takes writing the new master and moments into
    separate buffers (a speculative step that may be redone leaves the state as it was) than
    updating them in place: fp32 state, all threads; 1.0 in profiles stored before it was measured."""
    cuda_context_bytes: int = 0
    """Device memory in use outside torch's caching allocator once the profile's kernels ran
    (CUDA context, loaded kernel modules, library handles; other processes on the GPU count too);
    0 in profiles stored before it was measured (`budgets.DEFAULT_CUDA_CONTEXT_BYTES` then)."""

    def gemm_rate(self, shape: str | None = None) -> float:
        """FLOP/s for a GEMM shape (falls back to the mean of measured shapes)."""
        t = self.gemm_tflops.get(shape) if shape else None
        return 1e12 * (t if t else self.gemm_tflops["default"])

    def cpu_adam_rate(self, threads: int, node_ranks: int = 1, dtype: str = "float32") -> float:
        """params/s of one process's CPU optimizer with `threads` threads and states in `dtype`
        while `node_ranks` processes run theirs at once on the machine: they share its memory
        bandwidth, so each gets at most 1/node_ranks of the rate of all their threads together."""
        table = self.cpu_adam_bf16_gparams if dtype == "bfloat16" and self.cpu_adam_bf16_gparams \
            else self.cpu_adam_gparams
        one = self._adam_rate_at(table, threads)
        return min(one, self._adam_rate_at(table, threads * node_ranks) / node_ranks) if node_ranks > 1 else one

    @staticmethod
    def _adam_rate_at(table: dict[str, float], threads: int) -> float:
        """Measured rate, linear between measured thread counts (proportional below the smallest,
        flat above the largest: more threads than measured are not assumed to help)."""
        pts = sorted((int(k), 1e9 * v) for k, v in table.items())
        if threads <= pts[0][0]:
            return pts[0][1] * threads / pts[0][0]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if threads <= k1:
                return r0 + (r1 - r0) * (threads - k0) / (k1 - k0)
        return pts[-1][1]


def save(p: HardwareProfile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(asdict(p), f, indent=1, sort_keys=True)


# fields of profiles stored by earlier versions, no longer used: dropped when read
RETIRED_FIELDS = (
    # CPU AdamW rate next to pinned H2D copies over the idle rate: it scattered between runs of
    # one machine while the engine's own AdamW ran at the idle rate, so the planner uses that
    "cpu_adam_under_h2d",
)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def from_dict(d: dict) -> HardwareProfile:
    """TypeError for what is not a profile: not an object, a field unknown or missing, or a field
    whose value is not of its kind (a hand-edited or truncated file)."""
    if not isinstance(d, dict):
        raise TypeError(f"a JSON object expected, got {type(d).__name__}")
    p = HardwareProfile(**{k: v for k, v in d.items() if k not in RETIRED_FIELDS})
    for f in fields(p):
        v = getattr(p, f.name)
        if f.type == "str":
            ok = isinstance(v, str)
        elif f.type in ("int", "float"):
            ok = _number(v)
        elif f.type == "bool":
            ok = isinstance(v, bool)
        elif f.type == "dict[str, float]":  # rates by GEMM shape or thread count
            ok = isinstance(v, dict) and all(_number(r) for r in v.values())
        else:
            ok = isinstance(v, dict)
        if not ok:
            raise TypeError(f"{f.name}={v!r}: expected {f.type}")
    if "default" not in p.gemm_tflops:
        raise TypeError("gemm_tflops: no 'default' rate")
    for name in ("cpu_adam_gparams", "cpu_adam_bf16_gparams"):  # the bf16 table may be empty
        table = getattr(p, name)
        if not all(k.isdigit() for k in table) or not (table or name == "cpu_adam_bf16_gparams"):
            raise TypeError(f"{name}={table!r}: expected rates by thread count")
    return p


def load(path: str) -> HardwareProfile:
    if not os.path.isfile(path):
        raise ConfigError(f"offload.profile={path!r}: file not found")
    try:
        with open(path) as f:
            return from_dict(json.load(f))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"offload.profile={path!r}: not a hardware profile ({e})") from None
