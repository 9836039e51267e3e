"""`kvhandoff explore`'s flags (imports nothing heavy: `--help` answers at once)."""

from __future__ import annotations

import argparse
import pathlib

#: The named bounds of tools/explore.py `CONFIGS` (a test keeps them equal).
CONFIG_NAMES = ("default", "direct", "fleet", "large", "lossy", "pull", "quick", "smoke")


def add_explore_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="default", choices=CONFIG_NAMES,
        help="named bounds (tools/explore.py CONFIGS; default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--all", action="store_true", help="go on past the first violation (up to 5 per world)")
    parser.add_argument("--first", action="store_true", help="stop at the first world with a violation")
    parser.add_argument(
        "--planted", metavar="MUTANTS_TOML", type=pathlib.Path,
        help="also plant each protocol mutant of explore.PLANTED from this catalogue (a source"
        " checkout's tests/mutation/mutants.toml), one at a time, and count those found",
    )
    parser.add_argument(
        "--planted-config", default="quick", choices=CONFIG_NAMES,
        help="the bounds each planted run explores (default: %(default)s)",
    )
