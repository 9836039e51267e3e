"""Control frames over TCP streams (`control_frames="stream"`, actors/_stream.py).

What would fail if it broke:
* frames to one peer arrive whole and in the order they were sent, those
  sent while the connection was still opening included;
* a peer whose stream cannot be opened gets every frame by Ray call, in
  order, none lost;
* a connection that does not open with the token, or that announces a frame
  over `MAX_FRAME_LEN`, is closed before anything of it is delivered; a
  delivery that raises costs that frame only;
* a forgotten peer (it left, or restarted) gets a new connection;
* on the real rank actors every control frame travels on a stream (not one
  rides a Ray call), the handoffs complete with every byte verified, a
  cancel mid-DMA drains and releases, every pool comes back whole; stray
  connections (no token, garbage, an oversize length) change nothing.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

from kvhandoff.actors._stream import TOKEN_LEN, FrameStreams, pack
from kvhandoff.protocol import MAX_FRAME_LEN

pytestmark = pytest.mark.ray

#: An upper bound for what must happen at once (a failure's bound, not a pace).
BOUND_S = 60.0


class _Handle:
    """What `FrameStreams` uses of a peer rank's actor handle: `stream_address.remote()`."""

    def __init__(self, address: Any) -> None:
        self.stream_address = self
        self._address = address

    def remote(self) -> Any:
        return self._address()


class _Side:
    """One rank's streams, with what it delivered and what it sent by Ray call."""

    def __init__(self, fail_on: bytes | None = None) -> None:
        self.delivered: list[bytes] = []
        self.by_call: list[list[bytes]] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self.arrived = asyncio.Event()
        self.fail_on = fail_on
        self.tasks: set[asyncio.Task[Any]] = set()
        self.streams = FrameStreams(lambda: "127.0.0.1", self.deliver, self.fallback, self.own, self.counters)

    def own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def deliver(self, frame: bytes) -> bool:
        if frame == self.fail_on:
            raise RuntimeError("a bug past the boundary")
        self.delivered.append(frame)
        self.arrived.set()
        return True

    def fallback(self, handle: Any, frames: list[bytes]) -> None:
        self.by_call.append(list(frames))

    async def until(self, n: int) -> None:
        async with asyncio.timeout(BOUND_S):
            while len(self.delivered) < n:
                self.arrived.clear()
                await self.arrived.wait()


def _frames(n: int, start: int = 0) -> list[bytes]:
    return [f"frame-{i}".encode() * (i % 3 + 1) for i in range(start, start + n)]


def test_frames_arrive_whole_and_in_order_also_those_sent_while_opening() -> None:
    async def scenario() -> tuple[_Side, _Side]:
        a, b = _Side(), _Side()
        peer = _Handle(b.streams.address)
        a.streams.send("b", peer, _frames(1))
        a.streams.send("b", peer, _frames(2, 1))  # the connection is still opening
        await b.until(3)
        for i in range(3, 39, 4):
            a.streams.send("b", peer, _frames(4, i))
        await b.until(39)
        a.streams.close()
        b.streams.close()
        return a, b

    a, b = asyncio.run(scenario())
    assert b.delivered == _frames(39)
    assert a.by_call == []
    assert a.counters["stream_opened"] == 1 and b.counters["stream_accepted"] == 1, (a.counters, b.counters)
    assert b.counters["frames_stream_in"] == 39


def test_a_peer_whose_stream_cannot_open_gets_every_frame_by_ray_call_in_order() -> None:
    async def unreachable() -> Any:
        raise ConnectionRefusedError("no server")

    async def scenario() -> _Side:
        a = _Side()
        peer = _Handle(unreachable)
        a.streams.send("b", peer, _frames(1))
        a.streams.send("b", peer, _frames(2, 1))
        async with asyncio.timeout(BOUND_S):
            while not a.by_call:
                await asyncio.sleep(0)
        a.streams.send("b", peer, _frames(2, 3))
        return a

    a = asyncio.run(scenario())
    assert [f for call in a.by_call for f in call] == _frames(5)
    assert a.by_call[0] == _frames(3)  # what waited for the connection goes first, in one call
    assert a.counters["stream_open_failed"] == 1 and a.counters["stream_opened"] == 0


async def _stray(b: _Side, payload: bytes) -> bytes:
    """Connect to `b` as a stranger, send `payload`; what `b` sends back before closing."""
    host, port, _ = await b.streams.address()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(payload)
    async with asyncio.timeout(BOUND_S):  # the rank closes it: read() ends
        back = await reader.read()
    writer.close()
    return back


def test_a_connection_without_the_token_is_closed_before_any_frame() -> None:
    async def scenario() -> _Side:
        b = _Side()
        wrong = b"x" * TOKEN_LEN
        assert await _stray(b, wrong + pack(_frames(3))) == b""
        b.streams.close()
        return b

    b = asyncio.run(scenario())
    assert b.delivered == [] and b.counters["stream_refused_token"] == 1, b.counters


def test_an_oversize_length_closes_the_connection_before_its_body() -> None:
    async def scenario() -> _Side:
        b = _Side()
        _, _, token = await b.streams.address()
        # One frame that fits, then a length over the cap and no body.
        payload = token.encode() + pack(_frames(1)) + (MAX_FRAME_LEN + 1).to_bytes(4, "little")
        await _stray(b, payload)
        b.streams.close()
        return b

    b = asyncio.run(scenario())
    assert b.delivered == _frames(1)
    assert b.counters["stream_dropped_oversize"] == 1, b.counters


def test_a_delivery_that_raises_costs_that_frame_only() -> None:
    bad = b"bad frame"

    async def scenario() -> _Side:
        a, b = _Side(), _Side(fail_on=bad)
        peer = _Handle(b.streams.address)
        a.streams.send("b", peer, [b"one", bad, b"two"])
        await b.until(2)
        a.streams.close()
        b.streams.close()
        return b

    b = asyncio.run(scenario())
    assert b.delivered == [b"one", b"two"]
    assert b.counters["stream_deliver_errors"] == 1


def test_a_forgotten_peer_gets_a_new_connection() -> None:
    async def scenario() -> tuple[_Side, _Side, int]:
        a, b = _Side(), _Side()
        peer = _Handle(b.streams.address)
        a.streams.send("b", peer, _frames(1))
        await b.until(1)
        opened = a.streams.open_count()
        a.streams.forget(lambda to: to != "b")
        a.streams.send("b", peer, _frames(1, 1))
        await b.until(2)
        a.streams.close()
        b.streams.close()
        return a, b, opened

    a, b, opened = asyncio.run(scenario())
    assert opened == 1
    assert b.delivered == _frames(2)
    assert a.counters["stream_opened"] == 2 and b.counters["stream_accepted"] == 2


# ---- the real rank actors with frames on streams ------------------------------------------


def test_rank_actors_carry_every_frame_on_streams(ray_cluster: Any) -> None:
    """`control_frames="stream"`: every control frame between the real rank
    actors travels on a stream (no frame rides a Ray call); handoffs
    complete with every byte verified, a cancel mid-DMA drains and
    releases, every pool comes back whole. Stray connections to a rank (no
    token; the token and garbage; the token and an oversize length) change
    nothing: a handoff after them completes."""
    from kvhandoff.protocol import Role

    from .helpers import assert_carried, assert_clean, carried_handoffs, gen_bytes

    async def strays(rank: Any) -> None:
        host, port, token = await rank.stream_address.remote()
        for payload in (
            b"y" * TOKEN_LEN + pack([b"\x00" * 64]),
            token.encode() + pack([b"KVHF garbage", b"\xff" * 40]),
            token.encode() + (MAX_FRAME_LEN + 1).to_bytes(4, "little"),
        ):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            await writer.drain()
            writer.close()

    async def then(dep: Any) -> Any:
        await strays((await dep.ranks(Role.GEN))[0])
        return await dep.handoff("st-after", 100, timeout=BOUND_S)

    done, cancelled, after, stats = asyncio.run(carried_handoffs("stream", "st", then))
    assert_carried(done, cancelled)
    assert after.outcome == "completed" and after.bytes_verified == gen_bytes(100, 1), after
    assert_clean(stats)
    sent = sum(s["counters"]["frames_sent"] for s in stats["ranks"])
    arrived = sum(s["counters"].get("frames_stream_in", 0) for s in stats["ranks"])
    for s in stats["ranks"]:
        counters = s["counters"]
        assert s["frames"] == "stream"
        assert counters["frames_sent"] > 0 and counters.get("stream_opened", 0) >= 1, counters
        assert counters.get("frame_calls", 0) == 0, counters  # not one frame on a Ray call
    gen = next(s for s in stats["ranks"] if s["role"] == "gen")["counters"]
    assert gen.get("stream_refused_token") == 1 and gen.get("stream_dropped_oversize") == 1, gen
    # The garbage was refused at the receive boundary: the peers' frames all arrived.
    assert arrived == sent + 2, (arrived, sent)
    assert sum(v for k, v in gen.items() if k.startswith("refused_")) >= 2, gen
