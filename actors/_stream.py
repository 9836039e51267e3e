"""Control frames over a TCP stream between rank actors: `FrameStreams`.

Theory of operation
-------------------
A one-way Ray actor call costs a rank about a millisecond of a busy host's
CPU per call, on each side (docs/design.md "Control frames"); a NIXL
notification is cheap to send but arrives only when the receiver polls. A
TCP connection between two rank processes, read by the receiving rank's own
event loop (no polling: the loop wakes when bytes arrive), carries a frame
for a few tens of microseconds of CPU.

- **Server.** A rank listens on its node's address, on a port the OS picks,
  from its first `address()` call. Whoever asks learns (host, port, token)
  through a Ray call to the rank, so only a holder of the rank's actor handle
  (a member of the Ray cluster) can learn the token.
- **Connection.** Per peer endpoint (an incarnation: a restarted peer is a
  new endpoint, a new connection), opened on the first frames sent to it.
  The connecting side sends the token first; a connection that does not
  open with it is closed before anything else is read.
- **Framing.** Each frame goes as a 4-byte little-endian length and the
  frame's bytes. A length over `MAX_FRAME_LEN` closes the connection before
  the body is read (msgspec decodes whatever it is given: the size is ours
  to bound); every frame read goes to the rank's receive boundary, which
  decodes it bounded and refuses what is not a valid frame (S3).
- **Order.** Frames to one peer are written on one connection, in the order
  the rank produced them. While the connection opens, frames for that peer
  wait behind the ones already queued; once it is open they go in order.
  If it cannot be opened (the peer is gone, its address cannot be reached),
  the waiting frames and every later one to that endpoint take the Ray
  call, in order: nothing is dropped here that a Ray call would deliver.
- **Loss.** A connection breaks when a process dies. A peer that died loses
  what was in flight to it, as a Ray call to a dead actor would: the
  protocol's death path (directory, quarantine, proof) handles that. A
  broken connection to a live endpoint is never reused: its later frames
  take the Ray call.

A rank's event loop owns every socket here (asyncio streams, not threads):
the frames are handled on the loop that owns the rank's state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from kvhandoff.protocol import MAX_FRAME_LEN, Endpoint

log = logging.getLogger("kvhandoff.stream")

__all__ = ["FrameStreams", "TokenServer", "pack"]

#: Bytes of the token a connection opens with (hex of 16 random bytes).
TOKEN_LEN = 32
#: A TCP connect that has not finished by then (a firewall that drops it)
#: gives up: that peer's frames take the Ray call. A bound, not a pace: a
#: connect on a reachable host ends at once.
OPEN_TIMEOUT_S = 10.0
_LEN = 4


def pack(frames: list[bytes]) -> bytes:
    """`frames` as the stream carries them: each a 4-byte length and its bytes."""
    return b"".join(len(f).to_bytes(_LEN, "little") + f for f in frames)


class TokenServer:
    """A TCP server on this node's address (a port the OS picks, from the
    first `address()` call) that hands `serve` only the connections that
    open with its token; one that does not is closed before anything else
    of it is read (counted as `refused`). The frame streams and the
    coordinators' call channels (actors/_channel.py) each run one."""

    def __init__(
        self,
        host: Callable[[], str],
        serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
        counters: collections.Counter[str],
        refused: str,
    ) -> None:
        self._host = host
        self._serve = serve
        self._counters = counters
        self._refused = refused
        self.token = secrets.token_hex(TOKEN_LEN // 2)
        self._server: asyncio.AbstractServer | None = None

    async def address(self) -> tuple[str, int, str]:
        """(host, port, token) of this server, started on first use."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self._host(), 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port), self.token

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await reader.readexactly(TOKEN_LEN)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if not secrets.compare_digest(token, self.token.encode()):
            self._counters[self._refused] += 1
            writer.close()
            return
        await self._serve(reader, writer)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


class FrameStreams:
    """One rank's frame streams: its server, and a connection per peer endpoint.

    `deliver(frame)` is the rank's receive boundary for one frame (it never
    raises for what a peer sent); `fallback(handle, frames)` sends frames by
    Ray call (one one-way `receive_frames`); `own(coroutine)` runs a task
    the rank owns (cancelled at its shutdown; a connection opens in one, so
    a round handler that sends a frame never waits for it). `counters` is
    the rank's."""

    def __init__(
        self,
        host: Callable[[], str],
        deliver: Callable[[bytes], Awaitable[Any]],
        fallback: Callable[[Any, list[bytes]], None],
        own: Callable[[Any], None],
        counters: collections.Counter[str],
    ) -> None:
        self._deliver = deliver
        self._fallback = fallback
        self._own = own
        self.counters = counters
        self._server = TokenServer(host, self._serve, counters, "stream_refused_token")
        #: Per peer endpoint: a writer (open), a list (frames waiting while it
        #: opens) or None (Ray calls: it could not be opened, or broke).
        self._out: dict[Endpoint, asyncio.StreamWriter | list[bytes] | None] = {}

    # -- the server --------------------------------------------------------------------

    async def address(self) -> tuple[str, int, str]:
        """(host, port, token) of this rank's server, started on first use."""
        return await self._server.address()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One peer's connection (its token checked): frames until it closes."""
        try:
            self.counters["stream_accepted"] += 1
            while True:
                n = int.from_bytes(await reader.readexactly(_LEN), "little")
                if n > MAX_FRAME_LEN:
                    self.counters["stream_dropped_oversize"] += 1
                    return  # before the body: a peer that sends this is not one of ours
                frame = await reader.readexactly(n)
                self.counters["frames_stream_in"] += 1
                try:
                    await self._deliver(frame)
                except Exception as exc:  # a bug past the boundary: this frame only
                    self.counters["stream_deliver_errors"] += 1
                    log.warning("stream: a frame's delivery raised: %r", exc)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer went away
        finally:
            writer.close()

    # -- sending -----------------------------------------------------------------------

    def send(self, to: Endpoint, handle: Any, frames: list[bytes]) -> None:
        """Send `frames` to peer `to` (its actor `handle`), in order after
        every frame sent to it before (module docstring)."""
        state = self._out.get(to, ())
        if state == ():
            waiting = list(frames)
            self._out[to] = waiting
            self._own(self._open(to, handle, waiting))
        elif isinstance(state, list):
            state.extend(frames)
        elif state is None:
            self._fallback(handle, frames)
        elif state.is_closing():
            self.counters["stream_broken"] += 1
            self._out[to] = None
            self._fallback(handle, frames)
        else:
            self.counters["stream_writes"] += 1
            state.write(pack(frames))

    async def _open(self, to: Endpoint, handle: Any, waiting: list[bytes]) -> None:
        try:
            host, port, token = await handle.stream_address.remote()
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                _, writer = await asyncio.open_connection(host, port)
            writer.write(token.encode() + pack(waiting))
        except Exception as exc:
            self.counters["stream_open_failed"] += 1
            log.debug("stream to %s not opened, Ray calls instead: %r", to, exc)
            if self._out.get(to) is waiting:
                self._out[to] = None
                self._fallback(handle, waiting)
            return
        if self._out.get(to) is waiting:
            self.counters["stream_opened"] += 1
            self.counters["stream_writes"] += 1
            self._out[to] = writer
        else:  # forgotten meanwhile (`forget`): nothing more goes to it
            writer.close()

    def forget(self, keep: Callable[[Endpoint], bool]) -> None:
        """Close the connections to every peer endpoint `keep` rejects (a peer
        instance left, or the endpoint was replaced by a new incarnation)."""
        for to in [t for t in self._out if not keep(t)]:
            state = self._out.pop(to)
            if isinstance(state, asyncio.StreamWriter):
                state.close()

    def open_count(self) -> int:
        """Connections open to peers (`stats`)."""
        return sum(isinstance(s, asyncio.StreamWriter) for s in self._out.values())

    def close(self) -> None:
        """Close the server and every connection."""
        self.forget(lambda _: False)
        self._server.close()
