"""The `kvhandoff demo` and `kvhandoff bench` flags, and nothing heavy.

`kvhandoff --help` builds every parser: this module imports only the standard
library (no Ray, torch, NIXL or numpy: a test checks it), so help and flag
errors come back at once. The subcommands' bodies (`cli/_demo.py`,
`cli/_bench.py`) are imported only after the flags parsed, and take their
defaults from here.

Every count is checked by its type: argparse refuses a bad value with exit
status 2 and one line naming the flag and what it expected. The types raise
`ArgumentTypeError`, whose message argparse prints as it is (for a
`ValueError` it would print the type function's name instead).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["add_demo_arguments", "add_bench_arguments"]

# -- demo defaults ------------------------------------------------------------------------

# Request sizes: log-uniform, so most requests are short and a few are long,
# like real prompts; and cheap enough for a 2-core machine.
MIN_TOKENS = 16
MAX_TOKENS = 1024
#: Default per-request timeout passed to `handoff` (`--timeout`). It bounds the
#: whole handoff; L1's bound (`_demo.run_workload`) is twice that plus slack.
REQUEST_TIMEOUT_S = 15.0
#: Default bound on starting the rank actors (`--start-timeout`, demo and
#: bench): generous, since a launch waits on progress and a rank that died
#: fails it at once.
START_TIMEOUT_S = 600.0
START_TIMEOUT_HELP = (
    "seconds the rank actors may take to start; a rank that dies while starting fails the launch at once"
)

# -- bench choices --------------------------------------------------------------------------

SECTIONS = ("data", "paged", "control", "cancel", "frames", "crossover", "scale", "engine", "soak")
#: What runs without `--sections` (frames is asked for by name).
DEFAULT_SECTIONS = ("data", "paged", "control", "cancel")
#: `Deployment.launch(data_mode=)`; the same tuple as `_stager.DATA_MODES`
#: (a test checks it), repeated here so that parsing imports no data plane.
DATA_MODES = ("auto", "direct", "staged")
#: `--memory`: where the KV buffers live (host or GPU).
MEMORY_KINDS = ("DRAM", "VRAM")
#: `--control-frames` (demo and bench): `Deployment.launch(control_frames=)`.
CONTROL_FRAMES = ("auto", "ray", "nixl", "stream")
CONTROL_FRAMES_HELP = (
    "how control frames travel between ranks (Deployment.launch(control_frames=)): "
    "stream (the default: a TCP connection per peer rank), ray (one-way actor calls), "
    "nixl (notifications, polled); auto: Ray calls or notifications, measured once per host at launch"
)
#: `kvhandoff demo --placement`.
PLACEMENTS = ("any", "pack", "spread")
#: `kvhandoff bench --paged-layouts`.
PAGED_LAYOUTS = ("tp2", "shared", "per-size")


# -- flag types -------------------------------------------------------------------------------


T = TypeVar("T")


def _checked(convert: Callable[[str], T], accept: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """A flag type: `convert` the text, and refuse a value that does not
    convert or that `accept` turns down ("expected {expected}, got 'text'")."""

    def parse(text: str) -> T:
        try:
            value: T | None = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
# NaN and the infinities are refused too.
positive_float = _checked(float, lambda v: 0 < v < math.inf, "a positive number")
non_negative_float = _checked(float, lambda v: 0 <= v < math.inf, "a number >= 0")
rate = _checked(float, lambda v: 0.0 <= v <= 1.0, "a number between 0 and 1")
#: Comma-separated positive integers ("64,256").
positive_ints = _checked(
    lambda text: [int(x) for x in text.split(",") if x.strip()],
    lambda values: bool(values) and all(v > 0 for v in values),
    "comma-separated positive integers",
)


def sections(text: str) -> str:
    """A comma-separated subset of SECTIONS (kept as the string `_bench` reads)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or set(names) - set(SECTIONS):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(SECTIONS)}, got {text!r}"
        )
    return ",".join(names)


def launch_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `Deployment.launch` / `Fleet.launch` keywords that `kvhandoff
    bench`'s deployment flags set, the same in every section that honours them."""
    return {
        "memory": args.memory,
        "round_timeout_s": args.round_timeout_s,
        "gpus_per_rank": args.gpus_per_rank,
        "control_frames": args.control_frames,
        "start_timeout_s": args.start_timeout,
    }


def _adder(parser: argparse.ArgumentParser) -> Callable[..., Any]:
    """`parser.add_argument` that appends "(default: ...)" to the help of
    every flag whose default says something (not None, not a switch's False)."""

    def add(*flags: str, help: str, **kw: Any) -> Any:
        default = kw.get("default")
        if default is not None and default is not False:
            help += " (default: %(default)s)"
        return parser.add_argument(*flags, help=help, **kw)

    return add


# Defaults are written as they would be typed (a list as "64,256"): argparse
# runs a string default through the flag's type, and the help shows it as typed.
# The demo's named defaults are numbers, which its body reads too.

# -- kvhandoff demo ------------------------------------------------------------------------------


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvhandoff demo` flags; every one has a default (the embedded demo)."""
    add = _adder(parser)
    add("--ctx-tp", type=positive_ints, default="2", help="CTX (prefill) tensor parallelism; with --ctx-instances, a comma list cycled over the instances")
    add("--gen-tp", type=positive_ints, default="1", help="GEN (decode) tensor parallelism; with --gen-instances, a comma list cycled over the instances")
    add("--ctx-instances", type=positive_int, default="1", help="CTX instances: above 1 (or --gen-instances above 1) runs a fleet, every request paired by the built-in chooser; with --chaos and both >= 2, a membership storm too")
    add("--gen-instances", type=positive_int, default="1", help="GEN instances (see --ctx-instances)")
    add("--requests", type=positive_int, default="300", help="number of requests")
    add("--cancel-rate", type=rate, default="0.3", help="fraction of requests cancelled, 0..1; when above 0 at least one request is cancelled in each way (every exact phase and a random delay) if there are enough requests")
    add("--concurrency", type=positive_int, default="16", help="requests in flight at once")
    add("--memory", choices=MEMORY_KINDS, default="DRAM", help="KV buffers in host (DRAM) or GPU (VRAM) memory")
    add("--gpus-per-rank", type=non_negative_float, default="0.0", help="VRAM: each rank's share of a GPU; 0: the cluster's GPUs shared by all ranks, at most 1")
    add("--data-mode", choices=DATA_MODES, default="auto", help="how chunks move: auto (staged for small pieces), direct, or staged forced")
    add("--pool-blocks", type=positive_int, default="1024", help="KV blocks per rank")
    add("--max-tokens", type=positive_int, default=MAX_TOKENS, help=f"largest request, in tokens (sizes are log-uniform from {MIN_TOKENS})")
    add("--seed", type=int, default="0", help="workload seed")
    add("--timeout", type=positive_float, default=REQUEST_TIMEOUT_S, help="per-request handoff timeout in seconds")
    add("--start-timeout", type=positive_float, default=START_TIMEOUT_S, help=START_TIMEOUT_HELP)
    add("--address", default=None, help="join the existing Ray cluster at ADDRESS (its GCS host:port, as `ray start --head` prints it) instead of starting a local one; RAY_ADDRESS does the same")
    add("--placement", choices=PLACEMENTS, default="any", help="where the CTX and GEN instances go: any node each, both on one node (pack), or on two different nodes (spread); an instance's ranks always share a node")
    add("--json", action="store_true", help="print one JSON object on stdout and nothing else (no progress on stderr)")
    add("--unqualified", action="store_true", help="use pp=2 on both sides: outside the qualified scope, so the conservative path runs (a cancel waits for the transfer to finish)")
    add("--control-frames", choices=CONTROL_FRAMES, default="stream", help=CONTROL_FRAMES_HELP)
    add("--chaos", action="store_true", help="defer every DMA chunk's real post by 5 ms, so cancels meet DMA genuinely in flight; on a fleet of 2x2 or more: kill a rank, kill a coordinator, add an instance and drain one mid-traffic")


# -- kvhandoff bench -------------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvhandoff bench` flags (defaults: a run under ~2 minutes on 2 CPU cores)."""
    add = _adder(parser)
    add("--json", action="store_true", help="print one JSON object instead of tables")
    add("--sections", type=sections, default=",".join(DEFAULT_SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    add("--memory", choices=MEMORY_KINDS, default="DRAM", help="KV buffer memory (VRAM needs one GPU per rank)")
    add("--control-frames", choices=CONTROL_FRAMES, default="stream", help=CONTROL_FRAMES_HELP)
    add("--gpus-per-rank", type=positive_float, default="1.0", help="VRAM: each rank's share of a GPU (0.5: a CTX and a GEN rank share one)")
    add("--ctx-tp", type=positive_int, default="1", help="CTX tensor-parallel size (data/control/cancel)")
    add("--gen-tp", type=positive_int, default="1", help="GEN tensor-parallel size (data/control/cancel)")
    add("--sizes-mib", type=positive_ints, default="64,256", help="large handoff sizes in MiB (data section)")
    add("--data-mode", choices=DATA_MODES, default="auto", help="Deployment.launch(data_mode=) of the data, control and cancel sections")
    add("--round-timeout-s", type=positive_float, default="5.0", help="Deployment.launch(round_timeout_s=)")
    add("--staging-window", type=positive_int, default="4", help="staging slots per peer rank, each side")
    add("--staging-slot-mib", type=non_negative_int, default="0", help="one staging slot (one staged chunk) in MiB; 0: the device's default (128 MiB on a GPU, the chunk on the host)")
    add("--repeats", type=positive_int, default="5", help="repeats per variant in the data and paged sections")
    add("--chunk-mib", type=positive_int, default="16", help="WRITE chunk size in MiB (protocol and raw)")
    add("--paged-kib", type=positive_ints, default="16,64,256,1024", help="paged block sizes in KiB")
    add("--paged-mib", type=positive_int, default="64", help="bytes moved per paged WRITE, in MiB")
    add("--crossover-blocks", type=positive_ints, default="1,2,4,8,16,32,64,128,256,512", help="crossover section: request sizes in GEN blocks (4 pieces per block and CTX rank)")
    add("--crossover-kib", type=positive_int, default="16", help="crossover section: the piece size in KiB")
    add("--paged-layouts", choices=PAGED_LAYOUTS, default="tp2", help="tp2: per piece size, a CTX TP=2 -> GEN TP=1 deployment whose shard pieces are that size: raw direct, direct and staged handoffs, one contiguous raw WRITE, a copy; shared: runs of adjacent 16 KiB blocks on one deployment (raw only); per-size: one TP=1 deployment per block size (raw only)")
    add("--small-tokens", type=positive_int, default="16", help="tokens of a small handoff (control section)")
    add("--small-n", type=positive_int, default="60", help="sequential small handoffs for latency p50/p99")
    add("--concurrency", type=positive_ints, default="1,8,32", help="concurrent small handoffs for the rate")
    add("--big-blocks", type=positive_ints, default="128,8192", help="control section: request sizes in blocks whose control time (end to end - data phase) is compared, on a deployment of 64-byte blocks; the first is the reference")
    add("--big-n", type=positive_int, default="20", help="control section: handoffs per request size")
    add("--engine-spin-s", type=positive_float, default="1.0", help="engine section: seconds of the engine's Python loop per sample")
    add("--sustain-s", type=positive_float, default="3.0", help="seconds of sustained handoffs per concurrency")
    add("--ping-n", type=positive_int, default="1000", help="pipelined ping.remote() calls per rate sample")
    add("--scale-sizes", type=positive_ints, default="1,2,4", help="scale section: NxN fleets of tp=1 instances (each size once; all launched first, their windows interleaved)")
    add("--scale-repeats", type=positive_int, default="3", help="scale section: windows per setup, interleaved (each ratio is the median over the repeats)")
    add("--scale-clients", type=positive_int, default="4", help="scale section: clients per instance of a role")
    add("--admit-in-rounds", action="store_true", help="every section: a one-rank CTX instance admits in its rounds (the default: at the OPEN; docs/design.md)")
    add("--scale-admit-in-rounds", action="store_true", help="scale section only: as --admit-in-rounds")
    add("--soak-s", type=positive_float, default="600.0", help="soak section: seconds of small handoffs under cancels")
    add("--soak-warmup-s", type=non_negative_float, default="180.0", help="soak section: seconds before the memory growth is measured (the bounded memories fill: 120 s retention)")
    add("--soak-clients", type=positive_int, default="4", help="soak section: concurrent clients")
    add("--soak-cancel", type=rate, default="0.3", help="soak section: fraction of handoffs cancelled after a random delay")
    add("--soak-trace", action="store_true", help="soak section: also trace Python allocations (tracemalloc) and object counts in every process, and report what grew after the warm-up (slower; a diagnosis, not a measurement)")
    add("--frames-n", type=positive_int, default="2000", help="ping-pong round trips per frame size (frames)")
    add("--frames-burst", type=positive_int, default="10000", help="frames per one-way burst (frames)")
    add("--frames-bytes", type=positive_ints, default="200,2048", help="frame sizes in bytes (frames)")
    add("--cancels", type=positive_int, default="20", help="cancelled in-flight handoffs (cancel section)")
    add("--seed", type=int, default="0", help="seed for the cancel delays")
    add("--cancel-timeout-s", type=positive_float, default="3.0", help="wait for a cancelled trial's release before calling it leaked")
    add("--cancel-spare", type=non_negative_int, default="8", help="spare handoffs' worth of pool blocks for leaked cancel trials")
    add("--ucx-tls", default=None, help="set UCX_TLS before starting Ray (e.g. tcp: DMA stays in flight longer)")
    add("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    add("--start-timeout", type=positive_float, default=START_TIMEOUT_S, help=START_TIMEOUT_HELP)
    add("--plot", metavar="DIR", default=None, help="also write PNG plots into DIR: bandwidth vs size with the raw-NIXL and copy ceilings, latency CDFs, block-pool occupancy over time (sampled every 0.1 s during the control and cancel sections, which costs a stats call per rank); needs matplotlib")
