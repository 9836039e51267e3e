"""`kvhandoff` command line: `demo` and `bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the embedded demo (local Ray, host memory, NIXL/UCX)")
    sub.add_parser("bench", help="run the benchmarks")
    args = parser.parse_args(argv)
    print(f"kvhandoff {args.command}: not yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
