"""`kvhandoff` command line.

    kvhandoff demo [--json] [...]   the embedded default: local Ray, host memory, NIXL/UCX
    kvhandoff bench [...]           benchmarks, printed as ratios
    kvhandoff explore [--json]      every interleaving of small handoff worlds (no Ray)
    kvhandoff --version

Parsing is light: the flags live in `cli/_flags.py`, which imports no Ray,
torch, NIXL or numpy, so `--help`, `--version` and a bad flag answer at once.
Each subcommand's body (`cli/_demo.py`, `cli/_bench.py`,
`tools/explore.py`: `run(args) -> exit status`) is imported only once its
flags parsed.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata


def version() -> str:
    """The installed distribution's version (the source tree's when not installed)."""
    try:
        return metadata.version("kvhandoff")
    except metadata.PackageNotFoundError:
        from kvhandoff import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """Every flag of every subcommand (imports nothing heavy)."""
    from kvhandoff.cli import _flags

    parser = argparse.ArgumentParser(
        prog="kvhandoff", description="Cancellation-safe KV-cache handoff (Ray + NIXL)."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,explore}")
    demo = sub.add_parser(
        "demo",
        help="run the embedded demo (local Ray, host memory, NIXL/UCX)",
        description="Run a mixed workload with cancels at every phase on a local deployment "
        "and check the invariants. Exit status 0: every invariant held; 1: one did not; "
        "2: the deployment could not be launched.",
    )
    _flags.add_demo_arguments(demo)
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks (ratios vs raw NIXL and a plain copy)",
        description="Benchmarks of the performance targets, each a ratio to a baseline "
        "measured in the same run (docs/benchmarks.md).",
    )
    _flags.add_bench_arguments(bench)
    explore = sub.add_parser(
        "explore",
        help="explore every interleaving of small handoff worlds (the protocol, no Ray)",
        description="Drive the real protocol objects through every interleaving of small "
        "handoff worlds within bounds, checking S1-S4 and L1-L2 in every state. Exit status "
        "0: no violation (and every planted bug found); 1: otherwise.",
    )
    from kvhandoff.tools._flags import add_explore_arguments

    add_explore_arguments(explore)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "explore":  # the protocol alone: no Ray, no NIXL
        from kvhandoff.tools import explore

        return int(explore.run(args))
    # Quiet NIXL's per-agent INFO lines unless the user asked for them; set
    # before Ray starts, so that every worker inherits it.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    local_ray_auth(args, os.environ, sys.modules)
    try:
        # Joining a cluster (--address, RAY_ADDRESS): nothing Ray answers there
        # is one line and exit status 2, in seconds (issue 20). Before Ray is
        # imported: it reads the connect bounds this sets then.
        from kvhandoff.cli._address import check_join

        error = check_join(args, os.environ)
        if error is not None:
            print(f"kvhandoff {args.command}: {error}", file=sys.stderr)
            return 2
        # Only now the heavy part: Ray, torch, NIXL.
        command = importlib.import_module(f"kvhandoff.cli._{args.command}")
        return int(command.run(args))
    finally:
        _no_color_reset_at_exit()


def local_ray_auth(args: argparse.Namespace, environ: MutableMapping[str, str], modules: Mapping[str, object]) -> None:
    """Set RAY_AUTH_MODE=token in `environ` when the command will start a new
    local cluster (no RAY_ADDRESS, no --address) and nobody chose a mode.

    Ray 2.60 turns token authentication on for a new local cluster and logs a
    warning on every start unless RAY_AUTH_MODE says so
    (https://docs.ray.io/en/latest/ray-security/token-auth.html). This says
    so: the same mode, without the warning. Ray reads the variable when it is
    imported, so it is left alone once Ray is in `modules`; and joining a
    cluster keeps Ray's own choice (a token only if one is on this machine).
    """
    if environ.get("RAY_ADDRESS") or getattr(args, "address", None) or "ray" in modules:
        return
    environ.setdefault("RAY_AUTH_MODE", "token")


def _no_color_reset_at_exit() -> None:
    """Ray's vendored colorama (`colorama.init()` in a module `ray.init` imports)
    registers an exit hook that writes ESC[0m to stdout whenever stdout is a
    terminal: a stray escape sequence after our last line. Unregister it."""
    initialise = sys.modules.get("colorama.initialise")
    reset_all = getattr(initialise, "reset_all", None)
    if reset_all is not None:
        atexit.unregister(reset_all)

