"""Control frames over NIXL notifications: `NixlNotifChannel`.

Theory of operation
-------------------
A rank already owns one `nixl_agent` (its `NixlTransport`). NIXL can carry
small messages between agents besides WRITEs: `send_notif(peer, bytes)` sends
a standalone notification (a UCX active message, forced eager), and a WRITE may
carry one (`notif_msg` of `make_prepped_xfer` / `initialize_xfer`) that NIXL
sends only after the WRITE completed. The receiver drains both kinds, in
arrival order per sender, with `get_new_notifs()` -> {agent name: [bytes]}.

`NixlNotifChannel` puts the control frames of `kvhandoff.protocol._wire`
(OPEN, READY, CANCEL, TERMINAL, RECEIPT, REJECT) on that path:

- `send(peer, frame)` -> `send_notif`. The peer must have been added to the
  transport (`add_peer` of its metadata), and for replies the peer must have
  added ours: a channel needs both directions' `add_peer`.
- `poll()` drains `get_new_notifs()` and returns `[(sender agent, frame)]`,
  in arrival order per sender (senders are not ordered among themselves). It is
  the receive boundary, so it never raises for anything a peer sent: a payload
  over `MAX_FRAME_LEN` is dropped *before* any decoding (counted
  `dropped_oversize`), one that cannot be a frame (not bytes, shorter than the
  header, wrong magic) is dropped (counted `dropped_garbage`), and a NIXL error
  while draining is counted (`poll_failed`) and yields nothing. `poll_messages()`
  additionally decodes (bounded, `decode_frame`) and counts what does not
  decode (`dropped_undecodable`).
- `post_chunk(peer, work, frame, ...)` posts a WRITE chunk whose completion
  notification is `frame` (e.g. the edge's TERMINAL on its last chunk).

A frame that rode on a WRITE is not marked in any way: the receiver gets it
from the same `poll()` as any other frame, and decoding tells its kind (a
`Terminal` is a TERMINAL however it travelled). What the WRITE adds is an
ordering fact: NIXL sends the notification after the WRITE's flush completed,
so every byte of that chunk is in the receiver's memory before the frame shows
in its `get_new_notifs()` (tests/actors/test_frames.py checks it on real bytes).

NIXL facts this module relies on or works around (NIXL 1.5.1, UCX backend):

- A WRITE's notification is sent from the *sender's* `check_xfer_state` call
  that first sees the transfer complete (or from `transfer()` itself when it
  completes at once: 15 of 300 4 MiB host WRITEs in one test). A sender that
  never polls a pending chunk never sends it; a frame `send()`-ed after the
  post may arrive before or after it (whichever left first).
- A WRITE that ends in ERR sends no notification: the sender must then send
  its (failed) TERMINAL with `send()`.
- NIXL delivers notifications of any size (4 MiB went through in testing) and
  empty ones; the cap is ours to enforce, hence the check in `poll()`.
- The agent is not thread-safe: drive the channel from the thread that drives
  the transport (a Ray async actor's event loop).
- Nothing arrives unless the receiver polls: a NIXL notification is not a push
  like an actor call. Latency is bounded below by the receiver's poll interval.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from kvhandoff.protocol import (
    FRAME_HEADER_LEN,
    FRAME_MAGIC,
    MAX_FRAME_LEN,
    STAGE_MAGIC,
    DecodeError,
    FrameError,
    Message,
    decode_frame,
)

from ._dataplane import Chunk, ChunkPlan, DataPlaneError, NixlTransport, PreparedEdge, Region

log = logging.getLogger("kvhandoff.frames")

__all__ = ["NixlNotifChannel"]


class NixlNotifChannel:
    """One-way control frames between rank actors over NIXL notifications.

    Built on an existing `NixlTransport` (its agent and its `peers`); it adds
    no agent and no thread. `counters` counts what was sent, received and
    dropped.
    """

    def __init__(self, transport: NixlTransport, *, max_len: int = MAX_FRAME_LEN) -> None:
        if not FRAME_HEADER_LEN <= max_len <= MAX_FRAME_LEN:
            raise ValueError(f"max_len must be in [{FRAME_HEADER_LEN}, {MAX_FRAME_LEN}]")
        self.transport = transport
        self.max_len = max_len
        self.counters: collections.Counter[str] = collections.Counter()
        #: Staging notices (`kvhandoff.protocol.STAGE_MAGIC`) drained by `poll()`
        #: are kept here, `(sender, payload)`, for the staged data plane; None:
        #: they are dropped as garbage like any other non-frame.
        self.stage_sink: list[tuple[str, bytes]] | None = None
        # What get_new_notifs() returned and poll() has not handed out yet:
        # a send progresses the agent's worker (agents run without a progress
        # thread, so a notification leaves only when its sender progresses),
        # and whatever that drained waits here for the next poll().
        self._inbox: list[tuple[object, object]] = []

    @property
    def name(self) -> str:
        """Our agent name: what the peer's `poll()` reports as the sender."""
        return self.transport.name

    # -- sending -------------------------------------------------------------------------

    def _checked(self, peer: str, frame: bytes) -> bytes:
        # A local caller bug, not a peer's doing: raise.
        if peer not in self.transport.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r} (add_peer its metadata first)")
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise FrameError(f"a frame is bytes, not {type(frame).__name__}")
        frame = bytes(frame)
        if not FRAME_HEADER_LEN <= len(frame) <= self.max_len:
            raise FrameError(
                f"frame of {len(frame)} bytes is outside [{FRAME_HEADER_LEN}, {self.max_len}]"
            )
        return frame

    def send(self, peer: str, frame: bytes) -> bool:
        """Send `frame` to agent `peer`, one way. Returns whether NIXL took it
        (False, counted `send_failed` and logged, when `send_notif` raised: the
        frame is lost, as a one-way actor call to a dead actor is).

        Raises `DataPlaneError` for a peer never added and `FrameError` for a
        frame that is not bytes or not within [header, max_len] bytes.
        """
        frame = self._checked(peer, frame)
        if not self._send(peer, frame):
            return False
        self.counters["sent"] += 1
        return True

    def send_stage(self, peer: str, payload: bytes) -> bool:
        """Send a staging notice (`STAGE_MAGIC`, actors/_stager.py) to `peer`, one way."""
        if peer not in self.transport.peers:
            raise DataPlaneError(f"unknown peer agent {peer!r} (add_peer its metadata first)")
        if not self._send(peer, payload):
            return False
        self.counters["staged_sent"] += 1
        return True

    def _send(self, peer: str, payload: bytes) -> bool:
        try:
            self.transport.send_notif(peer, payload)
        except Exception as exc:
            self.counters["send_failed"] += 1
            log.warning("send_notif to %s failed: %s", peer, exc)
            return False
        self._drain()  # progress: the notification leaves now, not at the next poll
        return True

    def progress(self) -> None:
        """Progress the agent's worker: with no progress thread, a sender's
        notifications leave only while it progresses (`send` does once; a
        rank's poll loop does every sweep). What arrives meanwhile is kept
        for the next `poll()`."""
        self._drain()

    def _drain(self) -> bool:
        try:
            notifs = self.transport.agent.get_new_notifs()
            items = list(notifs.items())
        except Exception as exc:
            self.counters["poll_failed"] += 1
            log.warning("get_new_notifs failed: %s", exc)
            return False
        self._inbox.extend(items)
        return True

    def post_chunk(
        self,
        peer: str,
        work: Sequence[Region] | ChunkPlan,
        frame: bytes,
        prepared: PreparedEdge | None = None,
    ) -> Chunk:
        """Post one WRITE chunk to `peer` that delivers `frame` to the peer's
        `poll()` once every byte of the chunk has landed. The notification is
        sent by the post itself when the WRITE completes at once, else by the
        `Chunk.poll()` that first sees DONE (so a frame `send()`-ed after the
        post may arrive before or after it); none if the chunk ends in ERR
        (send the failure with `send()` then)."""
        frame = self._checked(peer, frame)
        chunk = self.transport.post(peer, work, notif=frame, prepared=prepared)
        self.counters["sent_on_write"] += 1
        return chunk

    # -- receiving -----------------------------------------------------------------------

    def poll(self) -> list[tuple[str, bytes]]:
        """Drain NIXL's new notifications: `[(sender agent, frame)]`, in arrival
        order per sender. Never raises; whatever is dropped is counted."""
        self._drain()
        items, self._inbox = self._inbox, []
        out: list[tuple[str, bytes]] = []
        for sender, payloads in items:
            name = sender.decode(errors="replace") if isinstance(sender, bytes) else str(sender)
            try:
                payloads = list(payloads)
            except Exception:
                self.counters["dropped_garbage"] += 1
                continue
            for payload in payloads:
                if not isinstance(payload, bytes | bytearray):
                    self.counters["dropped_garbage"] += 1
                    continue
                # The cap first: nothing looks inside an oversize payload.
                if len(payload) > self.max_len:
                    self.counters["dropped_oversize"] += 1
                    continue
                if self.stage_sink is not None and payload[: len(STAGE_MAGIC)] == STAGE_MAGIC:
                    self.counters["staged_received"] += 1
                    self.stage_sink.append((name, bytes(payload)))
                    continue
                if len(payload) < FRAME_HEADER_LEN or payload[:4] != FRAME_MAGIC:
                    self.counters["dropped_garbage"] += 1
                    continue
                self.counters["received"] += 1
                out.append((name, bytes(payload)))
        return out

    def poll_messages(self, *, version: int | None = None) -> list[tuple[str, Message]]:
        """`poll()`, decoded: `[(sender agent, message)]`. A frame that does not
        decode (`decode_frame` with our cap) is dropped and counted
        `dropped_undecodable`; nothing raises."""
        out: list[tuple[str, Message]] = []
        for sender, frame in self.poll():
            try:
                out.append((sender, decode_frame(frame, version=version, max_len=self.max_len)))
            except (FrameError, DecodeError) as exc:
                self.counters["dropped_undecodable"] += 1
                log.debug("undecodable frame from %s: %s", sender, exc)
        return out
