"""Benchmark: what a frame decode costs, legal and hostile, on this machine.

Not a test. The fuzz tests bound decode cost *relative* to the largest legal
frame (`tests.protocol.strategies.worst_case_open`); this prints the absolute
numbers behind that yardstick and one ratio per input against msgspec's own
untyped parse of the same body (the floor: what reading the bytes costs
before any schema or structural check).

For every input: best-of-N decode time in ms, size, MB/s, and the ratio
`decode_frame / msgspec.msgpack.decode(body)`.

    python bench/bench_wire.py [--runs 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvhandoff.protocol import (  # noqa: E402
    FRAME_HEADER_LEN,
    MAX_BLOCKS_PER_OPEN,
    ProtocolError,
    decode_frame,
    encode_frame,
    samples,
)
from tests.protocol import strategies as s  # noqa: E402
from tests.protocol.test_fuzz import _hostile_frames  # noqa: E402


def _best(fn: Any, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        with contextlib.suppress(ProtocolError, msgspec.MsgspecError, ValueError, RecursionError):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _inputs() -> dict[str, bytes]:
    frames = {f"sample {type(m).__name__}": encode_frame(m) for m in samples()}
    for blocks in (64, 1024, MAX_BLOCKS_PER_OPEN):
        frames[f"worst-case OPEN, {blocks} blocks"] = encode_frame(s.worst_case_open(blocks))
    frames.update({f"hostile: {k}": v for k, v in _hostile_frames().items()})
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    gc.collect()
    gc.disable()
    try:
        for name, frame in _inputs().items():
            body = frame[FRAME_HEADER_LEN:]
            ours = _best(lambda f=frame: decode_frame(f), args.runs)
            raw = _best(lambda b=body: msgspec.msgpack.decode(b), args.runs)
            rows.append(
                {
                    "input": name,
                    "bytes": len(frame),
                    "decode_ms": ours * 1e3,
                    "raw_parse_ms": raw * 1e3,
                    "ratio_to_raw": ours / raw,
                }
            )
    finally:
        gc.enable()
    print(f"{'input':46s} {'bytes':>8s} {'decode ms':>10s} {'MB/s':>8s} {'vs raw parse':>12s}")
    for r in rows:
        mbps = r["bytes"] / (r["decode_ms"] / 1e3) / 1e6
        print(
            f"{r['input'][:46]:46s} {r['bytes']:8d} {r['decode_ms']:10.3f} "
            f"{mbps:8.0f} {r['ratio_to_raw']:12.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
