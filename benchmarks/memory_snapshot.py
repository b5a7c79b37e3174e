"""What held GPU memory in a CUDA memory snapshot (``--profiling.enable_memory_snapshot``).

The trainer writes torchtitan's snapshots (``<dump>/<save_memory_snapshot_folder>/iteration_<step>[_exit]/
rank<r>_memory_snapshot.pickle``; ``_exit``: the step that ran out of memory). This prints the
allocated blocks alive when the snapshot was taken, and those alive at the highest allocated total
of the recorded history (replayed from its alloc/free events), each grouped by where they were
allocated (the innermost frame in flame's code, else the innermost Python frame), largest first.
It finds causes; https://pytorch.org/memory_viz shows the same file in full.

usage:
    python benchmarks/memory_snapshot.py SNAPSHOT.pickle [--top 25]
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

GIB = 2**30


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame in flame's code, else the innermost Python frame (frames are innermost first)."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    flame = [f for f in python if "/flame/" in f["filename"] and "/site-packages/" not in f["filename"]]
    frame = (flame or python or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{frame['filename'].split('/flame/')[-1]}:{frame['line']} {frame.get('name', '')}"


def live_blocks(snapshot: dict) -> list[tuple[int, str]]:
    """(bytes, allocation site) of every allocated block."""
    out = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                out.append((block["size"], allocation_site(block.get("frames", []))))
    return out


def live_at_peak(snapshot: dict) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes, its live blocks) over the recorded alloc/free history of the first device with
    one. Blocks allocated before the history starts count from its start: those alive at the end,
    and those whose free the history holds."""
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if not traces:
        return 0, []
    events = traces[0]
    allocated_in_trace = {e["addr"] for e in events if e["action"] == "alloc"}
    live: dict[int, tuple[int, str]] = {}
    for segment in snapshot["segments"]:
        if segment.get("device", 0) != 0:
            continue
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block["address"] not in allocated_in_trace:
                live[block["address"]] = (block["size"], allocation_site(block.get("frames", [])))
    seen_alloc = set()
    for e in events:  # frees of blocks allocated before the history
        if e["action"] == "alloc":
            seen_alloc.add(e["addr"])
        elif e["action"] == "free_requested" and e["addr"] not in seen_alloc:
            live.setdefault(e["addr"], (e["size"], allocation_site(e.get("frames", []))))
    total = sum(size for size, _ in live.values())
    peak, at_peak = total, list(live.values())
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], allocation_site(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, at_peak


def print_sites(title: str, blocks: list[tuple[int, str]], top: int) -> None:
    by_site: dict[str, list[int]] = defaultdict(list)
    for size, site in blocks:
        by_site[site].append(size)
    print(title)
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(sizes) / GIB:8.3f} GiB  {len(sizes):5d} blocks  largest {max(sizes) / GIB:.3f}  {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    blocks = live_blocks(snapshot)
    reserved = sum(s["total_size"] for s in snapshot["segments"])
    print_sites(f"{args.snapshot}: {sum(b for b, _ in blocks) / GIB:.3f} GiB allocated in {len(blocks)} blocks, "
                f"{reserved / GIB:.3f} GiB reserved in {len(snapshot['segments'])} segments", blocks, args.top)
    peak, at_peak = live_at_peak(snapshot)
    if at_peak:
        print_sites(f"at the recorded history's peak: {peak / GIB:.3f} GiB allocated", at_peak, args.top)

if __name__ == "__main__":
    main()
