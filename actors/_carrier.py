"""Which carrier takes control frames between rank actors, chosen per host at
start-up (`control_frames="auto"`; the default is "stream", actors/_stream.py,
which this module does not choose: it needs no probe).

Two carriers exist (docs/design.md "Control frames"): one-way Ray actor calls
and NIXL notifications between the ranks' own agents. Which one is faster
depends on the host, not on the code:

- a notification is cheap to send, but it arrives only when the receiver
  polls. A rank polls every `poll_interval_s` while it holds a live request,
  so the hop costs a poll interval plus whatever delays the poller;
- on a host with cores to spare the pollers run when they should and a
  notification hop beats a Ray call by a wide margin; on a small busy host
  they starve each other and the ranks' other work (docs/benchmarks.md: a
  notification round trip of 11.9 ms against a Ray call's 1 ms on two
  cores).

So "auto" measures instead of guessing: two throwaway actors on the
launcher's node, each with a NIXL agent, time notification round trips
(each side polling at the ranks' interval, as a rank's poll loop does)
against Ray actor-call round trips between the same two processes. NIXL
frames win only by a clear margin (`NIXL_MARGIN`). Hosts with fewer than
`MIN_CORES` usable cores take Ray calls without probing: there two pollers
and the ranks already share every core. The answer is cached per Ray node
for the life of the launcher's process, so a second deployment starts no
probe, and every rank of a deployment or fleet (restarts and instances
that join later included) gets the same carrier.

The choice is a launch-time fact, reported by the deployment's `stats()`
(`control_frames`). A fleet spread over unlike hosts should pass its
carrier explicitly.

What it measures is the latency of one hop. It is not the default because
on the GPU host notifications, while faster per hop, lowered the rate of a
saturated host (their pollers cost the ranks CPU) and one fleet chaos run
of two left a submission unanswered after a CTX rank was killed
(docs/design.md "Control frames").
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import ray

log = logging.getLogger(__name__)

__all__ = [
    "CARRIERS",
    "CarrierChoice",
    "MIN_CORES",
    "NIXL_MARGIN",
    "choose_carrier",
    "decide",
    "probe_carriers",
]

#: What `control_frames=` accepts.
CARRIERS = ("auto", "ray", "nixl", "stream")
#: Fewer usable cores than this: Ray calls, no probe (pollers would starve).
MIN_CORES = 4
#: NIXL frames only if a notification round trip is at most this share of a Ray call's.
NIXL_MARGIN = 0.5
#: Round trips timed per carrier (after as many to warm up).
PROBE_ROUNDS = 20
#: The rank's default poll interval (actors/rank/_config.py `RankConfig.poll_interval_s`).
POLL_INTERVAL_S = 0.0005

_CHOSEN: dict[str, CarrierChoice] = {}


@dataclass(frozen=True)
class CarrierChoice:
    """The carrier of a deployment's control frames and why it was taken."""

    carrier: str  # "ray", "nixl" or "stream"
    asked: str  # what control_frames= said
    why: str
    cores: int  # usable cores of the launcher's host
    ray_rtt_us: float | None = None  # p50 of the probe's Ray call round trips
    notif_rtt_us: float | None = None  # p50 of its notification round trips

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(ray_rtts: list[float], notif_rtts: list[float], rounds: int = PROBE_ROUNDS) -> tuple[str, str]:
    """The carrier from one probe's round trips (seconds), and why. Pure.

    NIXL only when every notification came back and its median round trip
    is at most `NIXL_MARGIN` of a Ray call's; anything less clear stays on
    Ray calls, the carrier that needs no polling."""
    if not ray_rtts:
        return "ray", "the probe timed no Ray call"
    if len(notif_rtts) < rounds:
        return "ray", f"only {len(notif_rtts)} of {rounds} notifications came back"
    r, n = statistics.median(ray_rtts) * 1e6, statistics.median(notif_rtts) * 1e6
    if n <= NIXL_MARGIN * r:
        return "nixl", f"a notification round trip ({n:.0f} us) is at most {NIXL_MARGIN:g}x a Ray call's ({r:.0f} us)"
    return "ray", f"a notification round trip ({n:.0f} us) is over {NIXL_MARGIN:g}x a Ray call's ({r:.0f} us)"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


async def choose_carrier(asked: str) -> CarrierChoice:
    """Resolve `control_frames=` to a carrier (Ray must be initialized).
    "ray" and "nixl" are taken as asked; "auto" is measured once per node."""
    cores = _cores()
    if asked != "auto":
        return CarrierChoice(asked, asked, "asked for", cores)
    node = ray.get_runtime_context().get_node_id()
    cached = _CHOSEN.get(node)
    if cached is not None:
        return cached
    if cores < MIN_CORES:
        choice = CarrierChoice("ray", "auto", f"{cores} usable cores (< {MIN_CORES}): pollers would starve", cores)
    else:
        try:
            ray_rtts, notif_rtts = await probe_carriers(node)
        except Exception as exc:  # the probe is advice: Ray calls always work
            log.warning("control-frame probe failed, using Ray calls: %r", exc)
            choice = CarrierChoice("ray", "auto", f"the probe failed: {type(exc).__name__}", cores)
        else:
            carrier, why = decide(ray_rtts, notif_rtts)
            choice = CarrierChoice(
                carrier, "auto", why, cores,
                ray_rtt_us=statistics.median(ray_rtts) * 1e6 if ray_rtts else None,
                notif_rtt_us=statistics.median(notif_rtts) * 1e6 if notif_rtts else None,
            )
    _CHOSEN[node] = choice
    log.info("control frames: %s (%s)", choice.carrier, choice.why)
    return choice


async def probe_carriers(node: str, rounds: int = PROBE_ROUNDS, timeout_s: float = 60.0) -> tuple[list[float], list[float]]:
    """Round trips (seconds) between two probe actors on `node`: Ray actor
    calls, then NIXL notifications with both sides polling at the ranks'
    interval. The actors are killed before it returns."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    tag = uuid.uuid4().hex[:8]
    a, b = (_Probe.options(scheduling_strategy=strategy).remote(f"kvh-probe-{tag}-{s}") for s in "ab")  # type: ignore[attr-defined]
    try:
        async with asyncio.timeout(timeout_s):
            meta_a, meta_b = await asyncio.gather(a.metadata.remote(), b.metadata.remote())
            await asyncio.gather(a.connect.remote(meta_b), b.connect.remote(meta_a))
            ray_rtts = await a.ray_round_trips.remote(b, 2 * rounds)
            echo = b.echo.remote(2 * rounds, POLL_INTERVAL_S)
            notif_rtts = await a.notif_round_trips.remote(2 * rounds, POLL_INTERVAL_S)
            await echo
        return list(ray_rtts[rounds:]), list(notif_rtts[rounds:])
    finally:
        for actor in (a, b):
            ray.kill(actor)


@ray.remote(num_cpus=0)
class _Probe:
    """One side of the probe: a NIXL agent (UCX, as the ranks') in its own process."""

    def __init__(self, name: str) -> None:
        from kvhandoff.actors._nixl import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self.peer = ""

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes) -> None:
        peer = self.agent.add_remote_agent(metadata)
        self.peer = peer.decode() if isinstance(peer, bytes) else str(peer)

    async def ping(self) -> None:
        return None

    async def ray_round_trips(self, other: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            await other.ping.remote()
            out.append(time.perf_counter() - start)
        return out

    async def _wait(self, interval: float, deadline: float) -> int:
        while time.perf_counter() < deadline:
            got = self.agent.get_new_notifs()
            if got:
                return sum(len(v) for v in got.values())
            await asyncio.sleep(interval)
        return 0

    async def echo(self, n: int, interval: float, timeout_s: float = 20.0) -> int:
        deadline = time.perf_counter() + timeout_s
        done = 0
        while done < n:
            k = await self._wait(interval, deadline)
            if not k:
                break
            for _ in range(k):
                self.agent.send_notif(self.peer, b"pong")
            done += k
        return done

    async def notif_round_trips(self, n: int, interval: float, timeout_s: float = 2.0) -> list[float]:
        out = []
        for _ in range(n):
            start = time.perf_counter()
            self.agent.send_notif(self.peer, b"ping")
            if not await self._wait(interval, start + timeout_s):
                break
            out.append(time.perf_counter() - start)
        return out
