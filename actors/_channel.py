"""Round calls over a TCP connection between a coordinator and each of its
ranks: `CallChannel`, `CallServer` (a rank's side) and `RankLinks` (a
coordinator's side).

Theory of operation
-------------------
A Ray actor call costs a busy host about a millisecond of CPU, split between
the caller and the callee (docs/design.md "Round calls"). A round costs its
coordinator one vote call per rank, or one apply call per rank, and a rank
pushes its news with one report call: on the 2-core box these were most of
the Ray calls a small handoff still made once clients batch their
submissions. The same messages written on a TCP connection that each side's
event loop reads cost tens of microseconds. So, with `control_frames=
"stream"`, a coordinator opens one connection to each rank incarnation and
both sides call over it:

- **Who opens.** The coordinator, when it seats a rank incarnation (at start
  and at every restart or re-attach). It learns (host, port, token) through
  one Ray call to the rank (`call_address`), so only a holder of the rank's
  actor handle learns the token; the connection opens with it, and the rank
  closes one that does not before reading anything else.
- **What goes over it.** Coordinator to rank: `round_vote`, `round_apply`
  and `admit_alone`, each answered on the same connection. Rank to
  coordinator: `report`, one way. Anything else (joins, identities,
  restarts, the watch of a rank's death) stays a Ray call.
- **Framing and bounds.** Each message is a 4-byte little-endian length and a
  msgpack array ``[kind, call id, name, payload]``. A length over
  `MAX_CALL_LEN` closes the connection before the body is read; a body that
  does not decode as that envelope closes it too; a payload is decoded into
  the method's typed arguments (the protocol's msgspec structs, their bounds
  checked as every decoder of ours does), and one that does not fit is
  answered with an error and changes nothing. A message the sender would
  have to write over the bound goes by Ray call instead.
- **Calls.** A request's handler runs as a task of the receiving loop, as an
  async actor's method does under Ray: requests start in the order they
  arrived and may interleave at their awaits. A handler's exception goes
  back as a `RemoteCallError` naming its type and message.
- **Fallback, never loss.** Until the connection is open, and forever after
  it broke or could not open, every call to that incarnation is the Ray
  call it always was. A connection breaks when either process dies: every
  call still waiting on it fails with `ConnectionError`, as a Ray call to a
  dead actor fails; the coordinator's watchdog and fail policy treat it as
  they treat that. A report that finds no open connection takes the Ray
  call.

Everything here runs on the event loop that owns the actor's state (the
rank's, or the endpoint's inside an engine's actor).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec

from kvhandoff.actors._coordinator_errors import (
    AdmissionStopped,
    CoordinatorError,
    InstanceDraining,
    ParentInFlight,
    RoundTimeout,
    TopologyFailed,
)
from kvhandoff.actors._stream import TokenServer
from kvhandoff.protocol import (
    AdmissionRequest,
    RankReport,
    RoundDecision,
    RoundError,
    RoundProposal,
    RoundVote,
)

log = logging.getLogger("kvhandoff.channel")

__all__ = [
    "MAX_CALL_LEN",
    "CallChannel",
    "CallServer",
    "Handler",
    "RESULTS",
    "RankLinks",
    "RemoteCallError",
    "WIRE_ERRORS",
    "carried_by",
    "late",
    "connect",
    "coordinator_handlers",
    "rank_handlers",
]

#: The longest message a channel carries (bytes). A round's messages are far
#: below it; a longer one goes by Ray call, and a peer that announces one is
#: disconnected before its body is read.
MAX_CALL_LEN = 64 * 1024 * 1024
#: A TCP connect that has not finished by then gives up (Ray calls instead).
#: A bound, not a pace: a connect on a reachable host ends at once.
OPEN_TIMEOUT_S = 10.0
_LEN = 4
_REQUEST, _REPLY, _ERROR = 0, 1, 2

_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, int, str, msgspec.Raw])
_ENCODER = msgspec.msgpack.Encoder()
#: What carried the call now running in this task: "channel" inside a
#: channel's handler, else "call" (a Ray call). Traces label hops with it.
_CARRIER: contextvars.ContextVar[str] = contextvars.ContextVar("kvhandoff_carrier", default="call")


def carried_by() -> str:
    """The carrier of the call this task is handling ("channel" or "call")."""
    return _CARRIER.get()


#: The reply of each call a coordinator makes over a channel, decoded as.
RESULTS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "round_vote": msgspec.msgpack.Decoder(RoundVote),
    "round_apply": msgspec.msgpack.Decoder(int),
    "admit_alone": msgspec.msgpack.Decoder(tuple[bool, RankReport | None]),
}


def late(owner: Any, name: str) -> Callable[..., Awaitable[Any]]:
    """``owner.<name>``, looked up at each call (a test harness may wrap it
    on the instance after the channel's handlers were made)."""

    def call(*args: Any) -> Awaitable[Any]:
        return getattr(owner, name)(*args)  # type: ignore[no-any-return]

    return call


def rank_handlers(rank: Any) -> dict[str, Handler]:
    """What a rank answers on its channel: its actor methods of the same name
    (`admit_alone` only where the rank has it: a GEN rank)."""
    handlers = {
        "round_vote": Handler(
            msgspec.msgpack.Decoder(tuple[RoundProposal, int | None, RoundDecision | None]), late(rank, "round_vote")
        ),
        "round_apply": Handler(msgspec.msgpack.Decoder(tuple[RoundDecision, int | None]), late(rank, "round_apply")),
    }
    if hasattr(rank, "admit_alone"):
        handlers["admit_alone"] = Handler(
            msgspec.msgpack.Decoder(tuple[AdmissionRequest, int | None, int, RoundDecision | None]),
            late(rank, "admit_alone"),
        )
    return handlers


def coordinator_handlers(coordinator: Any) -> dict[str, Handler]:
    """What a coordinator answers on its channels: a rank's `report`."""
    return {"report": Handler(msgspec.msgpack.Decoder(tuple[RankReport]), late(coordinator, "report"))}


#: The errors a channel carries as themselves: the caller raises the same
#: type, built from the same arguments (what a Ray call would raise, less the
#: Ray wrapper). Any other error arrives as a `RemoteCallError`.
WIRE_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        RoundError, ParentInFlight, CoordinatorError, RoundTimeout, AdmissionStopped, TopologyFailed, InstanceDraining,
    )
}
_ERROR_PAYLOAD = msgspec.msgpack.Decoder(tuple[str, list[Any] | None])


def _wire_args(exc: BaseException) -> list[Any] | None:
    """The constructor arguments `exc` pickles with (its `__reduce__`)."""
    reduced = exc.__reduce__()
    return list(reduced[1]) if isinstance(reduced, tuple) and len(reduced) > 1 and isinstance(reduced[1], tuple) else None


def _read_error(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _remote_error(name: str, message: str, args: list[Any] | None) -> BaseException:
    cls = WIRE_ERRORS.get(name)
    if cls is not None and args is not None:
        try:
            return cls(*args)
        except Exception:  # arguments that do not build it: the generic form
            pass
    return RemoteCallError(name, message)


class RemoteCallError(RuntimeError):
    """A call over a channel raised on the other side: its type's name and message."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name

    def __reduce__(self) -> tuple[Any, ...]:
        type_name, _, message = str(self).partition(": ")
        return (type(self), (type_name, message))


class Handler(NamedTuple):
    """A method a channel answers: the decoder of its argument tuple, and the coroutine function."""

    args: msgspec.msgpack.Decoder[Any]
    call: Callable[..., Awaitable[Any]]


class CallChannel:
    """One connection carrying calls both ways: requests answered by this
    side's `handlers`, and this side's own calls and one-way messages.
    `counters` gets what a channel counts (calls, messages refused)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handlers: dict[str, Handler],
        counters: collections.Counter[str],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handlers = handlers
        self.counters = counters
        self._pending: dict[int, tuple[asyncio.Future[Any], msgspec.msgpack.Decoder[Any]]] = {}
        self._next_id = 1
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: Messages written in this turn of the loop: they go in one send at
        #: its end (`_flush`), one wakeup of the other side for all of them.
        self._corked: list[bytes] = []
        self.done = asyncio.get_running_loop().create_task(self._read())

    @property
    def closed(self) -> bool:
        return self._closed or self._writer.is_closing()

    def call(self, method: str, args: tuple[Any, ...], result: msgspec.msgpack.Decoder[Any]) -> asyncio.Future[Any] | None:
        """Send a call; its future gets the reply decoded by `result`. None if
        the channel is closed or the message would be over `MAX_CALL_LEN`:
        the caller sends it by Ray call instead."""
        if self.closed:
            return None
        call_id = self._next_id
        if not self._write(_REQUEST, call_id, method, args):
            return None
        self._next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A caller that stopped waiting (its round ended, the process shuts
        # down) leaves a closed channel's error unread: read, not logged.
        future.add_done_callback(_read_error)
        self._pending[call_id] = (future, result)
        self.counters["channel_calls"] += 1
        return future

    def tell(self, method: str, args: tuple[Any, ...]) -> bool:
        """Send a one-way message; False if it could not go (see `call`)."""
        if self.closed or not self._write(_REQUEST, 0, method, args):
            return False
        self.counters["channel_tells"] += 1
        return True

    def close(self) -> None:
        """Close the connection; every call still waiting fails with `ConnectionError`."""
        if not self._closed:
            self._flush()
            self._closed = True
            self._writer.close()
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the call channel closed before the reply"))

    # -- the wire ------------------------------------------------------------------------

    def _write(self, kind: int, call_id: int, name: str, payload: Any) -> bool:
        body = _ENCODER.encode((kind, call_id, name, payload))
        if len(body) > MAX_CALL_LEN:
            self.counters["channel_oversize_sent_by_ray"] += 1
            return False
        if not self._corked:
            asyncio.get_running_loop().call_soon(self._flush)
        self._corked.append(len(body).to_bytes(_LEN, "little") + body)
        return True

    def _flush(self) -> None:
        corked, self._corked = self._corked, []
        if corked and not self._closed:
            self.counters["channel_sends"] += 1
            self._writer.write(b"".join(corked) if len(corked) > 1 else corked[0])

    def _error(self, call_id: int, exc: BaseException) -> None:
        """Answer call `call_id` with `exc`: its type's name, its message, and
        for a type of `WIRE_ERRORS` its constructor's arguments (the caller
        raises that very error), else none (a `RemoteCallError`)."""
        name = type(exc).__name__
        args = _wire_args(exc) if WIRE_ERRORS.get(name) is type(exc) else None
        try:
            self._write(_ERROR, call_id, name, (str(exc)[:2000], args))
        except (TypeError, msgspec.EncodeError):  # arguments the wire cannot carry
            self._write(_ERROR, call_id, name, (str(exc)[:2000], None))

    async def _read(self) -> None:
        try:
            while True:
                n = int.from_bytes(await self._reader.readexactly(_LEN), "little")
                if n > MAX_CALL_LEN:
                    self.counters["channel_dropped_oversize"] += 1
                    return  # before the body: a peer that sends this is not one of ours
                body = await self._reader.readexactly(n)
                try:
                    kind, call_id, name, payload = _ENVELOPE.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.counters["channel_dropped_malformed"] += 1
                    return
                if kind == _REQUEST:
                    self._request(call_id, name, payload)
                else:
                    self._reply(kind, call_id, name, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the other side went away
        finally:
            self.close()

    def _request(self, call_id: int, name: str, payload: msgspec.Raw) -> None:
        handler = self._handlers.get(name)
        try:
            if handler is None:
                raise LookupError(f"no method {name!r} on this channel")
            args = handler.args.decode(payload)
        except Exception as exc:  # refused at the boundary: nothing ran
            self.counters["channel_refused"] += 1
            if call_id:
                self._error(call_id, exc)
            return
        task = asyncio.get_running_loop().create_task(self._run(call_id, handler, args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, call_id: int, handler: Handler, args: tuple[Any, ...]) -> None:
        _CARRIER.set("channel")
        try:
            result = await handler.call(*args)
        except Exception as exc:
            if call_id and not self.closed:
                self._error(call_id, exc)
            elif not call_id:
                self.counters["channel_tell_errors"] += 1
                log.debug("channel: a one-way message's handler raised: %r", exc)
            return
        if not call_id or self.closed:
            return
        try:
            sent = self._write(_REPLY, call_id, "", result)
        except (TypeError, msgspec.EncodeError) as exc:  # a result the wire cannot carry
            self._error(call_id, exc)
            return
        if not sent:
            self._error(call_id, OverflowError("the reply is over the channel's bound"))

    def _reply(self, kind: int, call_id: int, name: str, payload: msgspec.Raw) -> None:
        entry = self._pending.pop(call_id, None)
        if entry is None:
            self.counters["channel_unmatched_replies"] += 1
            return
        future, decoder = entry
        if future.done():
            return
        try:
            if kind == _ERROR:
                message, args = _ERROR_PAYLOAD.decode(payload)
                future.set_exception(_remote_error(name, message, args))
            else:
                future.set_result(decoder.decode(payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            future.set_exception(exc)


async def connect(host: str, port: int, token: str, handlers: dict[str, Handler], counters: collections.Counter[str]) -> CallChannel:
    """Open a channel to a `CallServer` at (host, port), with its token."""
    async with asyncio.timeout(OPEN_TIMEOUT_S):
        reader, writer = await asyncio.open_connection(host, port)
    writer.write(token.encode())
    return CallChannel(reader, writer, handlers, counters)


class CallServer:
    """A rank's side: it listens (from its first `address()` call) and serves
    `handlers` on every connection that opens with its token. `accepted`
    gets each channel as it opens (the rank sends its reports on the last)."""

    def __init__(
        self,
        host: Callable[[], str],
        handlers: dict[str, Handler],
        accepted: Callable[[CallChannel], None],
        counters: collections.Counter[str],
    ) -> None:
        self._handlers = handlers
        self._accepted = accepted
        self.counters = counters
        self._server = TokenServer(host, self._serve, counters, "channel_refused_token")
        self._channels: set[CallChannel] = set()

    async def address(self) -> tuple[str, int, str]:
        """(host, port, token) of this server, started on first use."""
        return await self._server.address()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters["channel_accepted"] += 1
        channel = CallChannel(reader, writer, self._handlers, self.counters)
        self._channels.add(channel)
        self._accepted(channel)
        try:
            await channel.done
        finally:
            self._channels.discard(channel)

    def close(self) -> None:
        """Close the server and every channel it accepted."""
        for channel in list(self._channels):
            channel.close()
        self._server.close()


class RankLinks:
    """A coordinator's side: one channel per rank incarnation, opened when
    the coordinator seats it (`open`), used by `call` while it is open for
    that very handle; every other call is the Ray call (module docstring).
    `own` runs a task the coordinator owns (the opening)."""

    def __init__(
        self, handlers: dict[str, Handler], counters: collections.Counter[str], own: Callable[[Any], None]
    ) -> None:
        self._handlers = handlers
        self.counters = counters
        self._own = own
        #: rank -> (the handle it is for, its channel, or None while it opens
        #: and after it could not open: Ray calls)
        self._links: dict[int, tuple[Any, CallChannel | None]] = {}

    def open(self, rank: int, handle: Any) -> None:
        """Start opening a channel to `handle`, the incarnation of `rank`
        seated now; the one to an earlier incarnation closes."""
        self.drop(rank)
        self._links[rank] = (handle, None)
        self._own(self._open(rank, handle))

    async def _open(self, rank: int, handle: Any) -> None:
        try:
            host, port, token = await handle.call_address.remote()
            channel = await connect(host, port, token, self._handlers, self.counters)
        except Exception as exc:  # a rank without a server (another carrier), or unreachable
            self.counters["channel_open_failed"] += 1
            log.debug("channel to rank %d not opened, Ray calls instead: %r", rank, exc)
            return
        if self._links.get(rank, (None, None))[0] is handle:
            self.counters["channel_opened"] += 1
            self._links[rank] = (handle, channel)
        else:  # replaced meanwhile
            channel.close()

    def channel(self, rank: int, handle: Any) -> CallChannel | None:
        """The open channel to `handle` as `rank`, if there is one."""
        held, channel = self._links.get(rank, (None, None))
        if held is not handle or channel is None or channel.closed:
            return None
        return channel

    def call(
        self, rank: int, handle: Any, method: str, args: tuple[Any, ...], result: msgspec.msgpack.Decoder[Any]
    ) -> tuple[Awaitable[Any], str]:
        """Call `method(*args)` on `handle` (rank `rank`): over its channel if
        open, else by Ray call. Returns the awaitable reply and the carrier
        ("channel" or "reply", as traces name a Ray call's answer). Counts
        ``<method>_by_channel`` or ``<method>_by_ray``."""
        channel = self.channel(rank, handle)
        if channel is not None:
            future = channel.call(method, args, result)
            if future is not None:
                self.counters[f"{method}_by_channel"] += 1
                return future, "channel"
        self.counters[f"{method}_by_ray"] += 1
        return getattr(handle, method).remote(*args), "reply"

    def drop(self, rank: int, handle: Any = None) -> None:
        """Close the channel to `rank` (its incarnation died or was replaced);
        with `handle`, only if the channel is to that incarnation."""
        held, channel = self._links.get(rank, (None, None))
        if handle is not None and held is not handle:
            return
        self._links.pop(rank, None)
        if channel is not None:
            channel.close()

    def open_count(self) -> int:
        return sum(c is not None and not c.closed for _, c in self._links.values())

    def close(self) -> None:
        for rank in list(self._links):
            self.drop(rank)
