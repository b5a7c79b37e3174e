"""Time the launch tiles of flame's attention kernels on this GPU and write them as shipped defaults.

    python -m flame.ops.attention.tune --out flame/ops/attention/tuned_tiles.json
        [--shapes 16x4096x16x64,4|4096x16x128] [--modes softmax,softpick,rectified] [--layouts dense,varlen]

Each shape ``BxTxHxD`` runs forward + backward once per mode and layout with
``FLAME_ATTN_AUTOTUNE=force`` (every candidate timed again; the winners also go to this machine's
disk cache). ``--out`` gets the tuned entries in this GPU's block of ``tuned_tiles.json``: the
file's other GPUs and this GPU's entries of other shapes are kept, the tuned ones replaced. Defaults: the 340M transformers' attention (16 heads of
64, batch 16 x 4096) and B=4 T=4096 H=16 D=128 (the shape of the committed tile sweep).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from flame.errors import ConfigError
from flame.utils.cli import CliParser

DEFAULT_SHAPES = "16x4096x16x64,4x4096x16x128"


def _parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"--shapes entry {item!r}: expected BxTxHxD, e.g. 4x4096x16x128")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def varlen_offsets(total: int, max_len: int) -> list[int]:
    """Document offsets over ``total`` tokens: lengths cycle through fractions of ``max_len``
    (the first document is the longest, so the max_seqlen bucket matches the dense run)."""
    fractions = (1.0, 0.375, 0.625, 0.125, 0.875)
    cuts, pos, i = [0], 0, 0
    while pos < total:
        pos = min(total, pos + max(1, int(max_len * fractions[i % len(fractions)])))
        cuts.append(pos)
        i += 1
    return cuts


def tune_shapes(shapes, modes, layouts, dtype_name: str = "bfloat16") -> set:
    """Run every (shape, mode, layout) once with forced tuning; the TileKeys that were tuned."""
    import torch

    from flame.ops.attention import parallel_attention, tiles

    dtype = getattr(torch, dtype_name)
    before = set(tiles._MEMO)
    for B, T, H, D in shapes:
        for layout in layouts:
            cu = None
            if layout == "varlen":
                cu = torch.tensor(varlen_offsets(B * T, T), device="cuda", dtype=torch.int32)
            for mode in modes:
                q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for _ in range(4))
                for x in (q, k, v):
                    x.requires_grad_()
                parallel_attention(q, k, v, mode, cu_seqlens=cu).backward(do)
                torch.cuda.synchronize()
                print(f"tuned {mode} {layout} B={B} T={T} H={H} D={D}", flush=True)
    return {key for key in set(tiles._MEMO) - before}


def merge_tuned(data: dict, device: str, tuned: dict, source: str, triton_ver: str, torch_ver: str) -> None:
    """Put the ``tuned`` entries into ``device``'s block of a shipped-defaults document: its entries
    of other keys stay, and its source then names both tunings."""
    block = data.setdefault("devices", {}).get(device) or {}
    kept = {n: e for n, e in block.get("tiles", {}).items() if n not in tuned}
    if kept and block.get("source"):
        source = f"{block['source']}; then {source}"
    data["devices"][device] = {"source": source, "triton": triton_ver, "torch": torch_ver,
                               "tiles": dict(sorted({**kept, **tuned}.items()))}


def main(argv=None) -> int:
    p = CliParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="shipped-defaults JSON to write (this GPU's block is replaced)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated BxTxHxD")
    p.add_argument("--modes", default="softmax,softpick,rectified")
    p.add_argument("--layouts", default="dense,varlen")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args(argv)
    try:
        import torch

        from flame.ops.attention import check_mode, tiles

        shapes = _parse_shapes(a.shapes)
        modes = [m.strip() for m in a.modes.split(",")]
        for m in modes:
            check_mode(m)
        layouts = [x.strip() for x in a.layouts.split(",")]
        if not set(layouts) <= {"dense", "varlen"}:
            raise ConfigError(f"--layouts {a.layouts!r}: expected dense and/or varlen")
        if not torch.cuda.is_available():
            raise ConfigError("python -m flame.ops.attention.tune needs a CUDA GPU")
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    os.environ["FLAME_ATTN_AUTOTUNE"] = "force"
    tiles.TIMING_REP_MS = 200  # shipped winners: time each candidate long enough to rank close ones
    keys = tune_shapes(shapes, modes, layouts, a.dtype)
    device = tiles.device_name()
    cache = tiles.cache_path(device, tiles.flame_version(), tiles.triton_version())
    with open(cache) as f:
        measured = json.load(f)["tiles"]
    names = sorted(key.name() for dev, key in keys if dev == device)
    out = Path(a.out)
    data = {"format": 1, "devices": {}}
    if out.exists():
        with open(out) as f:
            data = json.load(f)
    source = (f"python -m flame.ops.attention.tune --shapes {a.shapes} --modes {a.modes} --layouts {a.layouts} "
              f"({datetime.date.today().isoformat()}, triton {tiles.triton_version()}, torch {torch.__version__})")
    merge_tuned(data, device, {n: measured[n] for n in names}, source, tiles.triton_version(), torch.__version__)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, out)
    print(f"wrote {len(names)} tiles for {device} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
