"""Control frames over NIXL notifications (`NixlNotifChannel`), on real NIXL
agents: two in this process, and two in Ray actors, moving real host bytes.

Every wait is on an observable condition (the frames arrived, the chunk is
DONE) under a generous bound, never a sleep for its own sake."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch

from kvhandoff.actors import _frames
from kvhandoff.actors._dataplane import DataPlaneError, KVBuffer, NixlTransport, XferState
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.protocol import (
    FRAME_HEADER_LEN,
    FRAME_MAGIC,
    MAX_FRAME_LEN,
    Cancel,
    CancelReason,
    FrameError,
    Ready,
    Terminal,
    TerminalKind,
    decode_frame,
    encode_frame,
    samples,
)

from .helpers import BOUND_S

pytestmark = pytest.mark.ray

TICKET = samples()[1].ticket
_names = itertools.count()


def ready(i: int) -> bytes:
    return encode_frame(Ready(ticket=TICKET, round_no=i))


def terminal(nbytes: int) -> bytes:
    return encode_frame(Terminal(ticket=TICKET, evidence=TerminalKind.COMPLETED, bytes_done=nbytes))


def header_only_junk(size: int) -> bytes:
    """A payload with a frame's magic that is not a frame (body is junk)."""
    return (
        FRAME_MAGIC
        + b"\x02\x02\x00\x00"
        + (size - FRAME_HEADER_LEN).to_bytes(4, "big")
        + (b"\xc1" * (size - FRAME_HEADER_LEN))
    )


def poll_until(
    channel: NixlNotifChannel,
    done: Callable[[list[tuple[str, bytes]]], bool],
    got: list[tuple[str, bytes]] | None = None,
    also: Callable[[], Any] | None = None,
) -> list[tuple[str, bytes]]:
    got = [] if got is None else got
    deadline = time.monotonic() + BOUND_S
    while not done(got):
        assert time.monotonic() < deadline, f"frames did not arrive: {len(got)} so far"
        got.extend(channel.poll())
        if also is not None:
            also()
    return got


# -- two agents in this process ----------------------------------------------------------


@pytest.fixture(scope="module")
def agents():
    n = next(_names)
    a = NixlTransport(f"fr-a{n}", KVBuffer(4, 1 << 20))
    b = NixlTransport(f"fr-b{n}", KVBuffer(4, 1 << 20))
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def channels(agents):
    a, b = agents
    ca, cb = NixlNotifChannel(a), NixlNotifChannel(b)
    # Nothing left over from an earlier test (they all wait for their last frame).
    assert ca.poll() == [] and cb.poll() == []
    ca.counters.clear()
    cb.counters.clear()
    return ca, cb


def test_frames_arrive_whole_and_in_order_both_ways(channels) -> None:
    ca, cb = channels
    sent = [ready(i) for i in range(500)]
    sent[123] = encode_frame(samples()[0])  # an OPEN among them: kinds mix freely
    for frame in sent:
        assert ca.send(cb.name, frame)
    # The sender progresses too (no progress thread: a queued notification
    # leaves only while its agent progresses).
    got = poll_until(cb, lambda g: len(g) >= len(sent), also=ca.progress)
    assert got == [(ca.name, f) for f in sent]  # same bytes, same order, named sender
    # The other way, decoded.
    for i in range(300):
        cb.send(ca.name, ready(1000 + i))
    msgs: list = []
    deadline = time.monotonic() + BOUND_S
    while len(msgs) < 300:
        assert time.monotonic() < deadline
        msgs.extend(ca.poll_messages())
        cb.progress()
    assert [(s, m.round_no) for s, m in msgs] == [(cb.name, 1000 + i) for i in range(300)]
    assert ca.counters["sent"] == 500 and cb.counters["received"] == 500
    assert cb.counters["sent"] == 300 and ca.counters["received"] == 300
    assert sum(v for k, v in ca.counters.items() if k.startswith("dropped")) == 0


def test_oversize_and_garbage_are_dropped_and_counted_never_raised(channels, agents) -> None:
    a, _ = agents
    ca, cb = channels
    at_cap = header_only_junk(MAX_FRAME_LEN)  # exactly the cap: passes poll, not decode
    hostile = [
        b"K" * (MAX_FRAME_LEN + 1),  # one byte over the cap
        header_only_junk(MAX_FRAME_LEN + 1),  # over the cap with a frame's header
        b"z" * (4 << 20),
        b"",  # NIXL delivers empty notifications too
        b"KVH",  # shorter than the header
        b"not a frame at all, no magic",
        at_cap,
        header_only_junk(64),
    ]
    for payload in hostile:
        a.send_notif(cb.name, payload)  # raw: a hostile peer does not use our send()
    sentinel = ready(7)
    ca.send(cb.name, sentinel)
    # The sender progresses too (agents have no progress thread): a 4 MiB
    # notification leaves in several steps.
    got = poll_until(cb, lambda g: bool(g) and g[-1][1] == sentinel, also=ca.progress)
    assert [f for _, f in got] == [at_cap, header_only_junk(64), sentinel]
    assert cb.counters["dropped_oversize"] == 3
    assert cb.counters["dropped_garbage"] == 3
    assert cb.counters["received"] == 3


def test_poll_messages_decodes_only_what_fits_the_cap(channels, agents, monkeypatch) -> None:
    a, _ = agents
    ca, cb = channels
    seen: list[int] = []
    real = _frames.decode_frame

    def spy(frame, **kw):
        seen.append(len(frame))
        return real(frame, **kw)

    monkeypatch.setattr(_frames, "decode_frame", spy)
    a.send_notif(cb.name, header_only_junk(MAX_FRAME_LEN + 4096))
    a.send_notif(cb.name, header_only_junk(100))
    cancel = Cancel(ticket=TICKET, reason=CancelReason.CLIENT, detail="x")
    ca.send(cb.name, encode_frame(cancel))
    msgs: list = []
    deadline = time.monotonic() + BOUND_S
    while not msgs:
        assert time.monotonic() < deadline
        msgs.extend(cb.poll_messages())
        ca.progress()  # the sender progresses too
    assert msgs == [(ca.name, cancel)]
    assert seen == [100, len(encode_frame(cancel))]  # the oversize one never reached a decoder
    assert cb.counters["dropped_oversize"] == 1
    assert cb.counters["dropped_undecodable"] == 1


def test_send_refuses_local_mistakes(channels) -> None:
    ca, cb = channels
    with pytest.raises(DataPlaneError):
        ca.send("nobody", ready(1))
    with pytest.raises(FrameError):
        ca.send(cb.name, b"x" * (MAX_FRAME_LEN + 1))
    with pytest.raises(FrameError):
        ca.send(cb.name, b"KVHF")
    with pytest.raises(FrameError):
        ca.send(cb.name, "a str")  # type: ignore[arg-type]
    small = NixlNotifChannel(ca.transport, max_len=64)
    with pytest.raises(FrameError):
        small.send(cb.name, ready(1))  # over this channel's own cap
    with pytest.raises(ValueError):
        NixlNotifChannel(ca.transport, max_len=MAX_FRAME_LEN + 1)
    assert ca.counters["sent"] == 0


def test_a_write_carries_terminal_after_its_bytes(channels, agents) -> None:
    a, b = agents
    ca, cb = channels
    nbytes = a.buffer.nbytes
    g = torch.Generator().manual_seed(5)
    a.buffer.tensor.copy_(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8))
    b.buffer.tensor.fill_(0)
    frame = terminal(nbytes)
    chunk = ca.post_chunk(cb.name, [(a.buffer.base, b.buffer.base, nbytes)], frame)
    ca.send(cb.name, ready(1))  # sent after the post, maybe before the chunk is polled DONE
    landed: list[bool] = []

    def on_arrival(got):
        # Checked as soon as it shows; READY(1) may come before or after it (the
        # WRITE's notification leaves at the post when the WRITE completes at once).
        if not landed and any(f == frame for _, f in got):
            landed.append(torch.equal(b.buffer.tensor, a.buffer.tensor))
        return bool(landed)

    poll_until(cb, on_arrival, also=chunk.poll)
    assert landed == [True]  # every byte was there when TERMINAL showed
    assert chunk.state is XferState.DONE and chunk.release()
    (msg,) = [decode_frame(frame)]
    assert isinstance(msg, Terminal) and msg.bytes_done == nbytes  # just a frame: decoding tells
    assert ca.counters["sent_on_write"] == 1


def test_poll_survives_whatever_the_agent_hands_back() -> None:
    good = ready(3)

    class Agent:
        def __init__(self, result):
            self.result = result

        def get_new_notifs(self):
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    class Transport:
        name, peers = "me", set()

        def __init__(self, result):
            self.agent = Agent(result)

    channel = NixlNotifChannel(Transport(RuntimeError("ucx down")))  # type: ignore[arg-type]
    assert channel.poll() == [] and channel.counters["poll_failed"] == 1
    odd = {b"bytes-name": [good, None, 17, "str", bytearray(good)], "x": 5}
    channel = NixlNotifChannel(Transport(odd))  # type: ignore[arg-type]
    assert channel.poll() == [("bytes-name", good), ("bytes-name", good)]
    assert channel.counters["dropped_garbage"] == 4


# -- two Ray actors -----------------------------------------------------------------------


@ray.remote(num_cpus=0)
class Peer:
    def __init__(self, name: str) -> None:
        self.buffer = KVBuffer(2, 1 << 20)
        self.transport = NixlTransport(name, self.buffer)
        self.channel = NixlNotifChannel(self.transport)
        self.got: list[tuple[str, bytes]] = []
        self._flushing = False
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._flusher = asyncio.get_running_loop().create_task(self._flush())

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def add_peer(self, md: bytes) -> str:
        return self.transport.add_peer(md)

    def send_ready(self, peer: str, start: int, n: int) -> int:
        sent = sum(self.channel.send(peer, ready(i)) for i in range(start, start + n))
        self._flushing = True
        return sent

    async def _flush(self) -> None:
        # No progress thread: keep progressing so queued notifications leave
        # (a rank's poll loop does this every sweep).
        while True:
            if self._flushing:
                self.channel.progress()
            await asyncio.sleep(0.001)

    def send_raw(self, peer: str, payloads: list[bytes]) -> None:
        for p in payloads:
            self.transport.send_notif(peer, p)
        self._flushing = True

    async def collect(self, n: int) -> list[tuple[str, int]]:
        """Poll (yielding to the loop) until n frames arrived; their round numbers."""
        deadline = time.monotonic() + BOUND_S
        while len(self.got) < n and time.monotonic() < deadline:
            self.got.extend(self.channel.poll())
            await asyncio.sleep(0)
        got, self.got = self.got, []
        return [(s, decode_frame(f).round_no) for s, f in got]

    def counters(self) -> dict[str, int]:
        return dict(self.channel.counters)

    def fill_random(self, seed: int) -> str:
        g = torch.Generator().manual_seed(seed)
        n = self.buffer.nbytes
        self.buffer.tensor.copy_(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
        return hashlib.sha256(self.buffer.tensor.numpy().tobytes()).hexdigest()

    def base(self) -> int:
        return self.buffer.base

    async def write_with_terminal(self, peer: str, remote_base: int) -> str:
        n = self.buffer.nbytes
        chunk = self.channel.post_chunk(peer, [(self.buffer.base, remote_base, n)], terminal(n))
        deadline = time.monotonic() + BOUND_S
        while chunk.poll() not in (XferState.DONE, XferState.ERR) and time.monotonic() < deadline:
            await asyncio.sleep(0)
        chunk.release()
        return chunk.state.value

    def clear(self) -> None:
        self.buffer.tensor.fill_(0)

    async def digest_at_terminal(self) -> tuple[str, int, str]:
        """Poll until a TERMINAL arrives; the digest of our buffer at that moment."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            for sender, msg in self.channel.poll_messages():
                if isinstance(msg, Terminal):
                    digest = hashlib.sha256(self.buffer.tensor.numpy().tobytes()).hexdigest()
                    return sender, msg.bytes_done, digest
            await asyncio.sleep(0)
        return "", -1, "timed out"


@pytest.fixture(scope="module")
def peers(ray_cluster):
    n = next(_names)
    a, b = Peer.remote(f"fr-ra{n}"), Peer.remote(f"fr-rb{n}")
    ray.get(a.add_peer.remote(ray.get(b.metadata.remote())))
    ray.get(b.add_peer.remote(ray.get(a.metadata.remote())))
    ray.get([a.start.remote(), b.start.remote()])
    yield a, b, f"fr-ra{n}", f"fr-rb{n}"
    for h in (a, b):
        ray.kill(h)


def test_actors_exchange_frames_in_order(peers) -> None:
    a, b, na, nb = peers
    collecting = b.collect.remote(2000)
    assert ray.get(a.send_ready.remote(nb, 0, 2000)) == 2000
    assert ray.get(collecting) == [(na, i) for i in range(2000)]
    collecting = a.collect.remote(100)
    ray.get(b.send_ready.remote(na, 5000, 100))
    assert ray.get(collecting) == [(nb, 5000 + i) for i in range(100)]


def test_actor_drops_hostile_payloads_and_keeps_going(peers) -> None:
    a, b, na, nb = peers
    before = ray.get(b.counters.remote())
    collecting = b.collect.remote(2)
    ray.get(a.send_raw.remote(nb, [b"\0" * (MAX_FRAME_LEN + 1), b"junk", ready(1)]))
    ray.get(a.send_ready.remote(nb, 2, 1))
    assert ray.get(collecting) == [(na, 1), (na, 2)]
    after = ray.get(b.counters.remote())
    assert after.get("dropped_oversize", 0) - before.get("dropped_oversize", 0) == 1
    assert after.get("dropped_garbage", 0) - before.get("dropped_garbage", 0) == 1


def test_actor_write_carries_terminal_after_every_byte(peers) -> None:
    a, b, na, nb = peers
    want = ray.get(a.fill_random.remote(11))
    ray.get(b.clear.remote())
    waiting = b.digest_at_terminal.remote()
    state = ray.get(a.write_with_terminal.remote(nb, ray.get(b.base.remote())))
    assert state == "DONE"
    assert ray.get(waiting) == (na, 2 << 20, want)


# ---- the real rank actors with frames on NIXL notifications -------------------------------


def test_rank_actors_carry_every_frame_on_notifications(ray_cluster) -> None:
    """`control_frames="nixl"`: every control frame between the real rank
    actors travels as a NIXL notification (no frame rides a Ray call), the
    handoffs complete with every byte verified, a cancel mid-DMA drains and
    releases, and every pool comes back whole."""
    from .helpers import assert_carried, assert_clean, carried_handoffs

    done, cancelled, _, stats = asyncio.run(carried_handoffs("nixl", "nx"))
    assert_carried(done, cancelled)
    assert_clean(stats)
    for s in stats["ranks"]:
        counters = s["counters"]
        assert counters.get("frames_nixl", 0) == counters["frames_sent"] > 0, counters
        assert counters.get("frame_calls", 0) == 0, counters  # not one frame on a Ray call
