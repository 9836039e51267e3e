"""`kvhandoff bench --sections frames`: one-way Ray actor calls vs NIXL notifications.

Theory of operation
-------------------
Two `FramePeer` actors (num_cpus=0, on the bench's cluster), each with its own
NIXL agent (a `NixlTransport` over a tiny host buffer) and a `NixlNotifChannel`,
connected both ways (Ray handles and `add_peer` of each other's metadata). A
frame travels one of two ways, exactly as a rank would send it:

- **ray**: `peer.on_frame.remote(frame)`, the ref dropped (one-way actor call;
  the receiver's method runs on arrival: a push);
- **nixl**: `channel.send(peer_agent, frame)`; the receiver runs a poll task,
  `channel.poll()` then `await asyncio.sleep(0)`, in a tight loop (the
  receiver must poll: nothing arrives otherwise). **nixl_poll_500us** is the
  same with `asyncio.sleep(0.0005)` between polls: the rank poll loop's
  shortest interval (`RankConfig.poll_interval_s`), so the price of not
  spinning.

Measurements, per payload size (payloads are exactly that many bytes, a frame
header then opaque bytes: they pass `poll()`'s checks, and no side decodes,
since decoding costs the same on both paths):

1. **one way** = RTT / 2 of a ping-pong A -> B -> A (the echo answers the
   same way it was reached), N round trips in blocks that rotate the transport
   order and alternate which actor originates. Also the CPU time (process time
   of both actors, every thread: Ray's core worker, NIXL's progress thread)
   per one-way frame.
2. **burst**: `burst` frames fired back to back one way, A -> B then B -> A:
   frames/s = burst / (receiver's last arrival - sender's first send), read on
   CLOCK_MONOTONIC, which both processes share on one host. The sender yields
   to its event loop every 256 frames. CPU per frame, sender and receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import struct
import time
from typing import Any

import ray

from kvhandoff.actors._dataplane import KVBuffer, NixlTransport
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.protocol import FRAME_HEADER_LEN, FRAME_MAGIC

__all__ = ["FramePeer", "payload", "measure"]

#: Ping-pong variants, and the poll interval each uses (None: a Ray push).
VARIANTS: dict[str, float | None] = {"ray": None, "nixl": 0.0, "nixl_poll_500us": 0.0005}


def payload(size: int) -> bytes:
    """`size` bytes that start with a frame header announcing the rest (v2, kind 2)."""
    if size < FRAME_HEADER_LEN:
        raise ValueError(f"a payload needs at least {FRAME_HEADER_LEN} bytes")
    body = size - FRAME_HEADER_LEN
    return FRAME_MAGIC + struct.pack("!BBHI", 2, 2, 0, body) + b"\xa5" * body


class FramePeer:
    """One side of the frames benchmark (wrapped with `ray.remote(num_cpus=0)`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.buffer = KVBuffer(1, 4096)
        self.transport = NixlTransport(name, self.buffer)
        self.channel = NixlNotifChannel(self.transport)
        self.peer: Any = None
        self.peer_agent = ""
        self.mode = "idle"  # "echo", "origin" or "count"
        self.waiter: asyncio.Future[None] | None = None
        self.target = 0
        self.count = 0
        self.last_arrival = 0.0
        self.all_in: asyncio.Event | None = None
        self.poller: asyncio.Task[None] | None = None
        self.cpu0 = 0.0

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def connect(self, peer: Any, metadata: bytes) -> str:
        self.peer = peer
        self.peer_agent = self.transport.add_peer(metadata)
        return self.peer_agent

    # -- arrivals ---------------------------------------------------------------------

    async def on_frame(self, frame: bytes) -> None:
        """The one-way Ray call's receiving end (what `receive_frame` is to a rank)."""
        self._arrived(frame, "ray")

    def _arrived(self, frame: bytes, via: str) -> None:
        if self.mode == "echo":
            if via == "ray":
                self.peer.on_frame.remote(frame)
            else:
                self.channel.send(self.peer_agent, frame)
        elif self.mode == "origin":
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)
        elif self.mode == "count":
            self.count += 1
            if self.count == self.target:
                self.last_arrival = time.monotonic()
                assert self.all_in is not None
                self.all_in.set()

    async def _poll(self, interval: float) -> None:
        while True:
            for _, frame in self.channel.poll():
                self._arrived(frame, "nixl")
            await asyncio.sleep(interval)

    # -- control from the driver --------------------------------------------------------

    async def start(self, mode: str, interval: float | None, target: int = 0) -> None:
        """Enter `mode`; poll NIXL every `interval` s (None: no poll task)."""
        await self.stop()
        self.mode, self.target, self.count = mode, target, 0
        self.all_in = asyncio.Event()
        if interval is not None:
            self.poller = asyncio.get_running_loop().create_task(self._poll(interval))
        self.cpu0 = time.process_time()

    async def stop(self) -> float:
        """Leave the mode; the process time spent since `start`."""
        cpu = time.process_time() - self.cpu0
        if self.poller is not None:
            self.poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.poller
            self.poller = None
        self.mode = "idle"
        return cpu

    def _send(self, via: str, frame: bytes) -> None:
        if via == "ray":
            self.peer.on_frame.remote(frame)
        else:
            self.channel.send(self.peer_agent, frame)

    async def pingpong(self, via: str, frame: bytes, n: int) -> list[float]:
        """n round trips to the (echoing) peer and back; each RTT in seconds."""
        loop = asyncio.get_running_loop()
        rtts = []
        for _ in range(n):
            self.waiter = loop.create_future()
            t0 = time.perf_counter()
            self._send(via, frame)
            await self.waiter
            rtts.append(time.perf_counter() - t0)
        self.waiter = None
        return rtts

    async def burst(self, via: str, frame: bytes, n: int) -> tuple[float, float]:
        """Fire n frames at the peer; (first send on CLOCK_MONOTONIC, process time)."""
        cpu0 = time.process_time()
        t0 = time.monotonic()
        for i in range(n):
            self._send(via, frame)
            if i % 256 == 255:
                await asyncio.sleep(0)
        return t0, time.process_time() - cpu0

    async def all_arrived(self) -> tuple[float, int]:
        """Wait until `target` frames arrived (count mode): (last arrival, count)."""
        assert self.all_in is not None
        await self.all_in.wait()
        return self.last_arrival, self.count

    def counters(self) -> dict[str, int]:
        return dict(self.channel.counters)


def _us(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}

    def pct(q: float) -> float:  # nearest rank
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e6

    return {
        "n": len(ordered),
        "p50_us": pct(0.5),
        "p99_us": pct(0.99),
        "mean_us": statistics.fmean(ordered) * 1e6,
        "min_us": ordered[0] * 1e6,
    }


async def measure(
    sizes: list[int], n: int, burst: int, blocks: int = 4, timeout_s: float = 120.0
) -> dict[str, Any]:
    """The frames section's numbers (see the module docstring)."""
    remote = ray.remote(num_cpus=0)(FramePeer)
    tag = f"{time.monotonic_ns():x}"
    a, b = remote.remote(f"frames-a-{tag}"), remote.remote(f"frames-b-{tag}")
    try:
        md_a, md_b = await asyncio.gather(a.metadata.remote(), b.metadata.remote())
        await asyncio.gather(a.connect.remote(b, md_b), b.connect.remote(a, md_a))
        rows = []
        for size in sizes:
            rows.append(await _one_size(a, b, payload(size), n, burst, blocks, timeout_s))
        counters = await asyncio.gather(a.counters.remote(), b.counters.remote())
    finally:
        for h in (a, b):
            ray.kill(h)
    return {
        "n_round_trips": n,
        "burst": burst,
        "sizes": rows,
        "channel_counters": {"a": counters[0], "b": counters[1]},
    }


async def _one_size(
    a: Any, b: Any, frame: bytes, n: int, burst: int, blocks: int, timeout_s: float
) -> dict[str, Any]:
    names = list(VARIANTS)
    rtts: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, float] = dict.fromkeys(names, 0.0)
    per_block = max(1, n // blocks)

    async def round_trips(variant: str, origin: Any, echo: Any, k: int) -> list[float]:
        interval = VARIANTS[variant]
        via = "ray" if interval is None else "nixl"
        await asyncio.gather(
            origin.start.remote("origin", interval), echo.start.remote("echo", interval)
        )
        try:
            got = await asyncio.wait_for(origin.pingpong.remote(via, frame, k), timeout_s)
        finally:
            spent = await asyncio.gather(origin.stop.remote(), echo.stop.remote())
        cpu[variant] += sum(spent)
        return got

    for variant in names:  # warm-up: connections, code paths
        await round_trips(variant, a, b, 100)
    cpu = dict.fromkeys(names, 0.0)
    for block in range(blocks):
        k = block % len(names)
        origin, echo = (a, b) if block % 2 == 0 else (b, a)
        for variant in [*names[k:], *names[:k]]:
            rtts[variant].extend(await round_trips(variant, origin, echo, per_block))

    one_way = {v: _us([r / 2 for r in rtts[v]]) for v in names}
    cpu_per_frame = {v: cpu[v] / (2 * len(rtts[v])) * 1e6 for v in names}

    async def one_burst(via: str, sender: Any, receiver: Any) -> dict[str, Any]:
        interval = None if via == "ray" else 0.0
        await receiver.start.remote("count", interval, burst)
        arrived = receiver.all_arrived.remote()
        t0, send_cpu = await sender.burst.remote(via, frame, burst)
        try:
            last, count = await asyncio.wait_for(arrived, timeout_s)
        finally:
            recv_cpu = await receiver.stop.remote()
        seconds = last - t0
        return {
            "frames": count,
            "seconds": seconds,
            "frames_per_s": count / seconds if seconds > 0 else float("nan"),
            "send_cpu_us_per_frame": send_cpu / burst * 1e6,
            "recv_cpu_us_per_frame": recv_cpu / burst * 1e6,
        }

    bursts: dict[str, dict[str, Any]] = {}
    for via in ("ray", "nixl"):
        await one_burst(via, a, b)  # warm-up
    for via in ("ray", "nixl"):
        ab = await one_burst(via, a, b)
        ba = await one_burst(via, b, a)
        bursts[via] = {
            "a_to_b": ab,
            "b_to_a": ba,
            "frames_per_s": min(ab["frames_per_s"], ba["frames_per_s"]),
        }

    ray_p50 = one_way["ray"].get("p50_us", float("nan"))
    return {
        "bytes": len(frame),
        "one_way": one_way,
        "pingpong_cpu_us_per_frame": cpu_per_frame,
        "burst": bursts,
        "nixl_over_ray_one_way_p50": one_way["nixl"].get("p50_us", float("nan")) / ray_p50,
        "nixl_poll_500us_over_ray_one_way_p50": one_way["nixl_poll_500us"].get(
            "p50_us", float("nan")
        )
        / ray_p50,
        "nixl_over_ray_burst": bursts["nixl"]["frames_per_s"] / bursts["ray"]["frames_per_s"],
    }
