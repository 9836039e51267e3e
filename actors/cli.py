"""`kvhandoff` command line.

    kvhandoff demo [--json] [...]   the embedded default: local Ray, host memory, NIXL/UCX
    kvhandoff bench [...]           benchmarks, printed as ratios

Each subcommand's flags and body live in its module (`actors/_demo.py`,
`actors/_bench.py`): `add_arguments(parser)` and `run(args) -> exit status`.
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    # Quiet NIXL's per-agent INFO lines unless the user asked for them.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvhandoff.actors import _bench, _demo

    parser = argparse.ArgumentParser(prog="kvhandoff", description="Cancellation-safe KV-cache handoff (Ray + NIXL).")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded demo (local Ray, host memory, NIXL/UCX)")
    _demo.add_arguments(demo)
    demo.set_defaults(run=_demo.run)
    bench = sub.add_parser("bench", help="run the benchmarks (ratios vs raw NIXL and a plain copy)")
    _bench.add_arguments(bench)
    bench.set_defaults(run=_bench.run)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
