"""Benchmark: the docs/design.md performance targets as ratios (same as `kvhandoff bench`).

Not a test. A thin wrapper so the benchmark runs from a checkout without the
console script; every flag is `kvhandoff bench`'s (cli/_bench.py):

    python bench/bench_handoff.py [--json] [--sections data,paged,control,cancel]
        [--sizes-mib 64,256] [--repeats 5] [--memory DRAM|VRAM] [--ctx-tp 1] [--gen-tp 1] ...

Method: docs/benchmarking.md; the current figures: docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from kvhandoff.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
