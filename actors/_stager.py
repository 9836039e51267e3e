"""The staged data plane on the rank actors (docs/design.md "Staged data plane").

`StagedWriter` (a CTX rank) turns a protocol chunk into: take a free slot
pair toward the chunk's GEN rank, gather the chunk's pieces into our slot,
post ONE WRITE of the slot into the GEN rank's matching slot carrying a
`StageWrite` notice, poll it to DONE/ERR, and report the chunk to the
protocol once the GEN rank's `StageAck` says the bytes were scattered into
its blocks. The protocol's TERMINAL(COMPLETED) therefore always follows the
last scatter. Chunks beyond the free slots wait in a queue per GEN rank (the
slots are the credits); a table whose slots are all quarantined makes the
chunk go direct, so a leaked slot never wedges a transfer.

`StagedReader` (a GEN rank) scatters a slot when its notice arrives (the
notice is sent after the WRITE's flush: the bytes are there), but only into
the blocks of a lease that is live and installed for exactly that request
(ParentKey with its attempts), and only for a slot of the sender's own
partition and a generation it has not seen; it always answers with a
`StageAck` (scattered or not), which is the writer's credit.

Cancellation at any moment:
- a queued chunk of an edge that stopped posting is reported failed without
  a WRITE (nothing was posted: quiescent);
- a posted slot drains like a direct chunk: polled to DONE/ERR, never
  released in flight; an edge that is draining reports it at DONE (its
  bytes do not matter any more), its slot stays held until the ACK;
- the reader never scatters into a lease that ended, so a late notice after
  the GEN rank released (and maybe reused) the blocks writes nothing.
A LANDED slot whose ACK does not come within the transfer timeout is
quarantined (`StagingSlots.expire`) and its chunk reported failed; it comes
back with the reader's late ACK or when the reader's agent is replaced.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from kvhandoff.actors._dataplane import (
    Chunk,
    ChunkPlan,
    DataPlaneError,
    KVMemory,
    NixlTransport,
    Piece,
    XferState,
    edge_pieces,
)
from kvhandoff.actors._faults import RankFaults
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.actors._names import agent_name
from kvhandoff.actors._staged import StageMap, StagingArena, gather, scatter, stage_map, stage_unit
from kvhandoff.protocol import (
    Action,
    BlockPool,
    ContextTicket,
    CtxRank,
    Endpoint,
    GenRank,
    ParentKey,
    ProtocolError,
    RankNamespace,
    RecentMemory,
    Role,
    SlotError,
    SlotGuard,
    SlotRef,
    StageAck,
    StageWrite,
    StagingSlots,
    encode_stage,
)
from kvhandoff.topology import ShardMap, memory_pieces

if TYPE_CHECKING:  # a type only: the rank package imports this module
    from kvhandoff.actors.rank._config import RankConfig

log = logging.getLogger("kvhandoff.staged")

__all__ = ["DATA_MODES", "StagedWriter", "StagedReader", "StagerHost", "WriterHost", "ReaderHost", "staged_below", "STAGED_BELOW", "STAGING_SLOT_BYTES", "staging_slot_bytes", "STAGED_MIN_DESCRIPTORS", "staged_min_descriptors"]

#: How a CTX rank moves an edge's chunks (`RankConfig.data_mode`).
DATA_MODES = ("auto", "direct", "staged")

#: "auto" stages an edge whose average piece is below this many bytes, per
#: device kind: the crossover measured by `kvhandoff bench --sections paged`
#: (docs/journal/2026-12-05-benchmarks-history.md "Staged vs direct"), where staged stops beating direct.
STAGED_BELOW = {"cpu": 8 << 10, "cuda": 1536 << 10}


#: A staging slot's bytes when `RankConfig.staging_slot_bytes` is 0, per
#: device kind (at least `chunk_bytes`): measured by `kvhandoff bench
#: --sections paged --staging-slot-mib N` (docs/journal/2026-12-05-benchmarks-history.md "Slot size").
STAGING_SLOT_BYTES = {"cpu": 0, "cuda": 128 << 20}


def staging_slot_bytes(config: Any, device: str) -> int:
    """The bytes of one staging slot (one staged chunk) of a rank with
    `config` whose KV lives on `device`."""
    if config.staging_slot_bytes > 0:
        return int(config.staging_slot_bytes)
    default = STAGING_SLOT_BYTES["cuda" if str(device).startswith("cuda") else "cpu"]
    return max(int(config.chunk_bytes), default)


def staged_below(device: str, override: int = 0) -> int:
    if override > 0:
        return override
    return STAGED_BELOW["cuda" if device.startswith("cuda") else "cpu"]


#: "auto" stages an edge only from this many descriptors (pieces x blocks)
#: on, per device kind: below it staging's fixed cost per chunk (a gather, a
#: notice, a scatter, an ACK) outweighs the per-descriptor cost it saves.
#: Measured by `kvhandoff bench --sections crossover` (docs/journal/2026-12-05-benchmarks-history.md
#: "Small requests").
STAGED_MIN_DESCRIPTORS = {"cpu": 2048, "cuda": 256}


def staged_min_descriptors(device: str, override: int = 0) -> int:
    if override > 0:
        return override
    return STAGED_MIN_DESCRIPTORS["cuda" if device.startswith("cuda") else "cpu"]


def _stages(config: Any, avg_piece: float, below: int, descriptors: int | None = None, least: int = 0) -> bool:
    """The mode rule for an edge whose pieces average `avg_piece` bytes and
    that moves `descriptors` pieces in all (None: not known here): forced,
    or "auto" with pieces under the crossover, at least two of them per
    chunk to merge, and at least `least` of them."""
    if config.data_mode == "direct" or avg_piece <= 0:
        return False
    if config.data_mode == "staged":
        return True
    if descriptors is not None and descriptors < least:
        return False
    return avg_piece < below and avg_piece * 2 <= config.chunk_bytes


@dataclasses.dataclass(eq=False)
class _Write:
    """One staged chunk from our slot to the peer's."""

    ticket: ContextTicket
    index: int
    nbytes: int
    gen_rank: int
    ref: SlotRef
    chunk: Chunk | None = None
    polled: XferState | None = None  # DONE/ERR once polled terminal
    ack: bool | None = None  # the reader's answer (scattered), once it came
    reported: bool = False
    posted_at: float = 0.0
    done_at: float = 0.0
    gather_at: float = 0.0
    notice: StageWrite | None = None
    region: tuple[int, int, int] | None = None
    gathered: Any = None  # the gather's CUDA event (a GPU slot)


@dataclasses.dataclass(eq=False)
class _Peer:
    """Our partition toward one GEN rank's current agent."""

    agent: str
    base: int  # the peer arena's base address
    slot_bytes: int
    window: int  # the peer's slots per CTX rank
    table: StagingSlots
    queue: collections.deque[tuple[ContextTicket, int, ChunkPlan]] = dataclasses.field(default_factory=collections.deque)


# -- what the stager needs of the rank core that hosts it ------------------------------
#
# The stager is typed against these protocols and never imports the rank
# package at run time: that package depends on this module. The rank
# cores satisfy them structurally: `CtxRankCore` is a `WriterHost`,
# `GenRankCore` a `ReaderHost` (actors/rank/). Their methods are bound once,
# when a writer or reader is built: a staged chunk calls them without a
# lookup through the core. What a core holds as a plain attribute is declared
# as one; read-only properties declare what a core computes and its config
# (the frozen `RankConfig`, named for type checking only).


class StagerHost(Protocol):
    """What a staged writer and a staged reader both read of their rank core."""

    ns: RankNamespace
    buffer: KVMemory

    @property
    def config(self) -> RankConfig: ...


class WriterHost(StagerHost, Protocol):
    """A CTX rank core, as its `StagedWriter` sees it."""

    side: CtxRank
    our: Endpoint
    transport: NixlTransport

    @property
    def xfer(self) -> RecentMemory[ParentKey, list[float]]:
        """The data phase per parent: [first post, last DONE, bytes]."""
        ...

    def edge_pieces(self, edge: tuple[int, int]) -> tuple[Piece, ...]:
        """An edge's per-block pieces toward the default pair, at most one chunk each."""
        ...

    def chunk_plans(self, ticket: ContextTicket) -> list[ChunkPlan]:
        """The WRITE chunks planned for `ticket`'s edge (at its OPEN)."""
        ...

    def perform(self, actions: list[Action]) -> list[Any]:
        """Perform what the protocol produced (a reported chunk's actions)."""
        ...

    def ensure_polling(self) -> None:
        """Make sure the poll loop runs (it polls what the writer posted)."""
        ...


class ReaderHost(StagerHost, Protocol):
    """A GEN rank core, as its `StagedReader` sees it."""

    side: GenRank
    pool: BlockPool
    shards: ShardMap
    #: The rank's fault state (actors/_faults.py; None in production).
    faults: RankFaults | None

    @property
    def channel(self) -> NixlNotifChannel:
        """The rank's NIXL notification channel (ACKs go out on it)."""
        ...


class StagedWriter:
    """A CTX rank's staged chunks (module docstring)."""

    def __init__(self, core: WriterHost, arena: StagingArena, window: int, below: int, least: int = 0) -> None:
        self.core = core
        # The core's methods a staged chunk calls, bound once (`WriterHost`).
        self._edge_pieces = core.edge_pieces
        self._chunk_plans = core.chunk_plans
        self._perform = core.perform
        self._ensure_polling = core.ensure_polling
        self._timing = core.xfer.get
        self.arena = arena
        self.window = window
        self.below = below
        self.least = least
        self._peers: dict[int, _Peer] = {}
        self._writes: dict[tuple[str, int, int], _Write] = {}  # (agent, slot, generation)
        self._posted: list[_Write] = []  # WRITEs not yet polled terminal
        self._gathering: collections.deque[tuple[_Peer, _Write]] = collections.deque()  # GPU gathers launched
        self._units: dict[tuple[Piece, ...], int] = {}
        self._starts: dict[ContextTicket, np.ndarray] = {}
        self._maps: dict[ContextTicket, StageMap] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        #: Seconds spent gathering, and from post to DONE and from DONE to ACK, summed.
        self.seconds: collections.Counter[str] = collections.Counter()

    # -- mode choice ----------------------------------------------------------------

    def wants(self, pieces: tuple[Piece, ...], geometry: Any, descriptors: int | None = None) -> bool:
        """Whether an edge with `pieces` (per block pair), `descriptors` in
        all, goes staged toward a GEN rank with `geometry`: forced, or "auto"
        and its pieces average under the crossover, with more than one piece
        per chunk to merge and enough of them to pay for a slot."""
        if not geometry.staging or not pieces:
            return False
        return self.wants_pieces(pieces, descriptors)

    def wants_pieces(self, pieces: tuple[Piece, ...], descriptors: int | None = None) -> bool:
        """The mode rule for an edge with `pieces`, whatever the peer has."""
        return bool(pieces) and _stages(
            self.core.config, sum(p[4] for p in pieces) / len(pieces), self.below, descriptors, self.least
        )

    # -- posting ------------------------------------------------------------------------

    def _peer(self, gen_rank: int, agent: str, geometry: Any) -> _Peer | None:
        base, slot_bytes, window = geometry.staging
        p = self._peers.get(gen_rank)
        if p is not None and p.agent != agent:
            self.peer_gone(gen_rank)  # a new incarnation: the old one reads nothing any more
            p = self._peers.get(gen_rank)
        if p is None:
            n = min(self.window, window)
            if n <= 0:
                return None
            p = self._peers[gen_rank] = _Peer(agent, base, slot_bytes, window, StagingSlots(n))
        return p

    def post(self, ticket: ContextTicket, index: int, plan: ChunkPlan, agent: str, geometry: Any, now: float) -> bool:
        """Post chunk `index` staged (or queue it for a slot): True. False: it
        goes direct (no usable slot table, or it does not fit a slot)."""
        p = self._peer(ticket.gen.ns.rank, agent, geometry)
        if p is None or plan.nbytes > min(p.slot_bytes, self.arena.slot_bytes):
            self.counters["staged_unfit"] += 1
            return False
        if not p.table.usable:
            self.counters["staged_no_usable_slot"] += 1
            return False
        ref = p.table.acquire((ticket, index))
        if ref is None:
            p.queue.append((ticket, index, plan))
            self.counters["staged_queued"] += 1
            return True
        self._start(p, ref, ticket, index, plan, now)
        return True

    def _unit(self, pieces: tuple[Piece, ...]) -> int:
        u = self._units.get(pieces)
        if u is None:
            u = self._units[pieces] = stage_unit(pieces, 0, self.core.buffer.strides)
        return u

    def _start(self, p: _Peer, ref: SlotRef, ticket: ContextTicket, index: int, plan: ChunkPlan, now: float) -> None:
        """Gather chunk `index` into our slot `ref` and post its WRITE. On a GPU
        the gather is only launched here: `poll` posts the WRITE once its event
        says the slot is full, so the gathers of a window queue back to back
        on the device while this loop goes on."""
        core = self.core
        rank = core.config.rank
        gen_rank = ticket.gen.ns.rank
        w = _Write(ticket, index, plan.nbytes, gen_rank, ref)
        local = gen_rank * self.window + ref.slot
        remote = rank * p.window + ref.slot
        try:
            pieces = self._edge_pieces(ticket.edge)
            slot = self.arena.slot(local)
            w.gather_at = time.perf_counter()
            m = self._map(ticket, index, plan, pieces, slot.device)
            t1 = time.perf_counter()
            gather(core.buffer, slot, m)
            self.seconds["gather_map"] += t1 - w.gather_at
            self.seconds["gather_call"] += time.perf_counter() - t1
            start, end = self._rows(ticket, index)
            w.notice = StageWrite(
                request_id=ticket.request_id,
                ctx_attempt=ticket.ctx_attempt,
                gen_attempt=ticket.gen_attempt,
                ctx_rank=rank,
                ctx_epoch=core.our.epoch,
                chunk=index,
                start=start,
                end=end,
                max_piece=core.config.chunk_bytes,
                slot=remote,
                generation=ref.generation,
                nbytes=plan.nbytes,
            )
            w.region = (self.arena.addr(local), p.base + remote * p.slot_bytes, plan.nbytes)
        except Exception as exc:  # nothing reached the peer: the chunk failed before DMA
            self._unposted(p, w, exc, now)
            return
        if slot.is_cuda:
            w.gathered = torch.cuda.Event()
            w.gathered.record(torch.cuda.current_stream(slot.device))
            self._gathering.append((p, w))
            self._ensure_polling()
            return
        self._send(p, w, now)

    def _unposted(self, p: _Peer, w: _Write, exc: Exception, now: float) -> None:
        log.warning("rank %s: staged post failed: %r", self.core.ns, exc)
        self.counters["staged_post_failed"] += 1
        p.table.freed(w.ref)
        self._report(w, False, now)
        self._drain_queue(p, now)

    def _send(self, p: _Peer, w: _Write, now: float) -> None:
        """Post the WRITE of a gathered slot, with its notice."""
        self.seconds["gather"] += time.perf_counter() - w.gather_at
        assert w.notice is not None and w.region is not None
        t0 = time.perf_counter()
        try:
            w.chunk = self.core.transport.post(p.agent, [w.region], notif=encode_stage(w.notice))
        except Exception as exc:  # nothing reached the peer: the chunk failed before DMA
            self._unposted(p, w, exc, now)
            return
        self.seconds["post_call"] += time.perf_counter() - t0
        self.counters["staged_chunks"] += 1
        self.counters["staged_bytes"] += w.nbytes
        w.posted_at = time.perf_counter()
        self._writes[(p.agent, w.notice.slot, w.ref.generation)] = w
        self._posted.append(w)
        self._ensure_polling()

    def _post_gathered(self, now: float) -> bool:
        """Post the WRITEs whose gathers finished (in launch order: one stream).
        A chunk whose edge stopped posting, or whose GEN agent was replaced,
        meanwhile is reported failed without a WRITE and its slot freed."""
        progressed = False
        while self._gathering:
            p, w = self._gathering[0]
            assert w.gathered is not None
            if not w.gathered.query():
                break
            self._gathering.popleft()
            progressed = True
            if self._peers.get(w.gen_rank) is not p:  # peer_gone: its table is gone too
                self.counters["staged_unposted"] += 1
                self._report(w, False, now)
            elif not self._posting(w.ticket):
                self.counters["staged_unposted"] += 1
                p.table.freed(w.ref)
                self._report(w, False, now)
                self._drain_queue(p, now)
            else:
                self._send(p, w, now)
        return progressed

    def _rows(self, ticket: ContextTicket, index: int) -> tuple[int, int]:
        """Chunk `index`'s rows [start, end) of the edge's transfer order (row
        k = pair k // P, piece k % P): `plan_chunks` cuts consecutive rows."""
        starts = self._starts.get(ticket)
        if starts is None:
            plans = self._chunk_plans(ticket)
            starts = np.concatenate(([0], np.cumsum([len(pl.local) for pl in plans])))
            self._starts[ticket] = starts
        return int(starts[index]), int(starts[index + 1])

    def _map(self, ticket: ContextTicket, index: int, plan: ChunkPlan, pieces: tuple[Piece, ...], device: Any) -> StageMap:
        """Chunk `index`'s gather map: a slice of the edge's whole map when that
        is simple (built once per edge session), else built for the chunk."""
        full = self._maps.get(ticket)
        if full is None:
            plans = self._chunk_plans(ticket)
            rows = np.concatenate([pl.local for pl in plans]) if plans else np.zeros(0, np.int64)
            full = stage_map(pieces, rows, 0, self.core.buffer, self._unit(pieces), device)
            self._maps[ticket] = full
        if full.simple:
            start, end = self._rows(ticket, index)
            return full.rows(start, end)
        return stage_map(pieces, plan.local, 0, self.core.buffer, self._unit(pieces), device)

    def prepare(self, ticket: ContextTicket) -> None:
        """Build the edge's gather map when its chunks are planned (the OPEN
        came, before READY), not at its first post: the data phase then
        starts with a gather, not with a map build (~1 ms per 16k rows).
        Only for an edge the mode would stage; never raises (the first post
        builds it then)."""
        plans = self._chunk_plans(ticket)
        rows = sum(len(pl.local) for pl in plans)
        if ticket in self._maps or not _stages(self.core.config, self._edge_avg(ticket), self.below, rows, self.least):
            return
        try:
            self._map(ticket, 0, plans[0], self._edge_pieces(ticket.edge), self.arena.tensor.device)
            self.counters["maps_prepared"] += 1
        except Exception as exc:
            self.counters["map_prepare_failed"] += 1
            log.debug("rank %s: gather map not prepared: %r", self.core.ns, exc)

    def _edge_avg(self, ticket: ContextTicket) -> float:
        pieces = self._edge_pieces(ticket.edge)
        return sum(p[4] for p in pieces) / len(pieces) if pieces else 0.0

    def forget(self, ticket: ContextTicket) -> None:
        self._starts.pop(ticket, None)
        self._maps.pop(ticket, None)

    def _drain_queue(self, p: _Peer, now: float) -> None:
        """Start queued chunks on the slots that are free now; a queued chunk
        whose edge stopped posting (cancelled) is reported failed, unposted."""
        while p.queue:
            ticket, index, plan = p.queue[0]
            if not self.core.side.may_post(ticket):
                p.queue.popleft()
                self.counters["staged_unposted"] += 1
                self._report(_Write(ticket, index, 0, 0, SlotRef(0, 0)), False, now)
                continue
            ref = p.table.acquire((ticket, index))
            if ref is None:
                return
            p.queue.popleft()
            self._start(p, ref, ticket, index, plan, now)

    # -- progress ---------------------------------------------------------------------

    def _report(self, w: _Write, ok: bool, now: float) -> None:
        if w.reported:
            return
        w.reported = True
        side = self.core.side
        timing = self._timing(w.ticket.parent)
        if ok and timing is not None:  # the data phase ends with the last scatter
            timing[1] = time.perf_counter()
            timing[2] += w.nbytes
        try:
            actions = side.chunk_done(w.ticket, w.index, w.nbytes, now) if ok else side.chunk_failed(w.ticket, w.index, now)
        except ProtocolError as exc:
            self.counters[f"report_{type(exc).__name__}"] += 1
            return
        self._perform(actions)

    def _posting(self, ticket: ContextTicket) -> bool:
        return self.core.side.may_post(ticket)

    def poll(self, now: float) -> bool:
        """Poll our posted WRITEs; report what is due; quarantine overdue slots."""
        progressed = self._post_gathered(now)
        timeout = self.core.side.transfer_timeout
        for w in list(self._posted):
            assert w.chunk is not None
            state = w.chunk.poll()
            if state is XferState.PROC or state is XferState.PENDING:
                continue
            progressed = True
            self._posted.remove(w)
            w.chunk.release()
            w.polled = state
            w.done_at = time.perf_counter()
            self.seconds["write"] += w.done_at - w.posted_at
            p = self._peers.get(w.gen_rank)
            if state is XferState.ERR:
                # No notice was sent: the reader never reads the slot.
                self._settle(p, w, scattered=False, now=now)
                continue
            if w.ack is not None:  # the ACK came first (the WRITE completed at post)
                self._settle(p, w, scattered=w.ack, now=now)
                continue
            if p is not None and p.agent == self._agent_of(w):
                with contextlib.suppress(SlotError):
                    p.table.landed(w.ref, now + timeout)
            if not self._posting(w.ticket):
                # Cancelled meanwhile: the WRITE is over, the bytes do not
                # matter; the reader scatters nothing into an ended lease.
                self._report(w, True, now)
        for p in list(self._peers.values()):
            for ref, _ in p.table.expire(now):
                self.counters["slots_quarantined"] += 1
                w = self._writes.get((p.agent, self._remote(p, ref), ref.generation))
                if w is not None:
                    self._report(w, False, now)
        return progressed

    def _remote(self, p: _Peer, ref: SlotRef) -> int:
        return self.core.config.rank * p.window + ref.slot

    def _agent_of(self, w: _Write) -> str | None:
        p = self._peers.get(w.gen_rank)
        if p is None:
            return None
        key = (p.agent, self._remote(p, w.ref), w.ref.generation)
        return p.agent if self._writes.get(key) is w else None

    def _settle(self, p: _Peer | None, w: _Write, scattered: bool, now: float) -> None:
        """The slot is free again (ACK, or ERR): report the chunk, next in queue."""
        if p is not None:
            key = (p.agent, self._remote(p, w.ref), w.ref.generation)
            if self._writes.get(key) is w:
                del self._writes[key]
                try:
                    p.table.freed(w.ref)
                except SlotError:
                    self.counters["slot_free_refused"] += 1
        self._report(w, scattered and w.polled is XferState.DONE, now)
        if p is not None:
            self._drain_queue(p, now)

    def on_ack(self, sender: str, ack: StageAck, now: float) -> None:
        p = next((q for q in self._peers.values() if q.agent == sender), None)
        if p is None:
            self.counters["ack_unknown_sender"] += 1
            return
        w = self._writes.get((sender, ack.slot, ack.generation))
        if w is None:
            self.counters["ack_stale"] += 1
            return
        self.counters["acks" if ack.scattered else "acks_unscattered"] += 1
        if w.done_at:
            self.seconds["ack_wait"] += time.perf_counter() - w.done_at
        w.ack = ack.scattered
        if w.polled is None:
            return  # the WRITE is not polled terminal yet: `poll` settles it
        self._settle(p, w, scattered=ack.scattered, now=now)

    def peer_gone(self, gen_rank: int) -> None:
        """GEN rank `gen_rank`'s agent was replaced or confirmed dead: nobody
        reads its slots any more. LANDED/QUARANTINED slots are freed (their
        chunks reported failed, if not yet); WRITING ones drain (polled to
        DONE/ERR, then dropped); queued chunks are reported failed."""
        p = self._peers.pop(gen_rank, None)
        if p is None:
            return
        now = time.monotonic()
        for ref, _ in p.table.reclaim_peer():
            self.counters["slots_reclaimed"] += 1
            w = self._writes.pop((p.agent, self._remote(p, ref), ref.generation), None)
            if w is not None:
                self._report(w, False, now)
        for key in [k for k in self._writes if k[0] == p.agent]:
            w = self._writes.pop(key)
            w.ack = False  # its WRITE still drains in `poll`; reported failed then
        while p.queue:
            ticket, index, _ = p.queue.popleft()
            self._report(_Write(ticket, index, 0, gen_rank, SlotRef(0, 0)), False, now)

    # -- state --------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self._posted or self._writes or self._gathering or any(p.queue for p in self._peers.values()))

    def writing_to(self, instance: str) -> bool:
        """Whether a chunk toward a rank of GEN instance `instance` is posted
        and not polled terminal, being gathered, or queued for a slot."""
        return (
            any(w.ticket.gen.ns.instance_id == instance for w in self._posted)
            or any(w.ticket.gen.ns.instance_id == instance for _, w in self._gathering)
            or any(t.gen.ns.instance_id == instance for p in self._peers.values() for t, _, _ in p.queue)
        )

    def in_flight(self) -> int:
        return len(self._posted) + len(self._gathering) + sum(len(p.queue) for p in self._peers.values())

    def stats(self) -> dict[str, Any]:
        slots: collections.Counter[str] = collections.Counter()
        for p in self._peers.values():
            p.table.check_invariants()
            slots.update(p.table.counts())
        return {
            "slots": dict(slots),
            "in_use": sum(v for k, v in slots.items() if k != "free"),
            "queued": sum(len(p.queue) for p in self._peers.values()),
            "counters": dict(self.counters),
            "seconds": dict(self.seconds),
        }


class StagedReader:
    """A GEN rank's side of the staged chunks (module docstring)."""

    def __init__(self, core: ReaderHost, arena: StagingArena, window: int) -> None:
        self.core = core
        # The core's channel's send, bound once (`ReaderHost`): every notice is ACKed.
        self._send_stage = core.channel.send_stage
        self.arena = arena
        self.window = window
        self.guard = SlotGuard()
        self._pieces: dict[tuple[tuple[int, int], int], tuple[Piece, ...]] = {}
        self._units: dict[tuple[Piece, ...], int] = {}
        self._maps: dict[tuple[ParentKey, tuple[int, int], int], StageMap] = {}  # per edge session
        self.counters: collections.Counter[str] = collections.Counter()
        #: GPU scatters launched, not yet ACKed: (sender, notice, CUDA event, launched at).
        self._pending: collections.deque[tuple[str, StageWrite, Any, float]] = collections.deque()
        self.seconds: collections.Counter[str] = collections.Counter()

    def _edge_pieces(self, edge: tuple[int, int], max_piece: int) -> tuple[Piece, ...]:
        key = (edge, max_piece)
        found = self._pieces.get(key)
        if found is None:
            cfg = self.core.config
            ctx_kind = cfg.peer_memory_kind or cfg.memory_kind
            found = edge_pieces(memory_pieces(self.core.shards, edge, ctx_kind, cfg.memory_kind), max_piece)
            if len(self._pieces) > 64:
                self._pieces.clear()
            self._pieces[key] = found
        return found

    def on_write(self, sender: str, msg: StageWrite, now: float) -> None:
        faults = self.core.faults  # actors/_faults.py; None in production
        if faults is not None and faults.notices is not None:
            faults.notices.append((sender, msg, now))
            return
        core = self.core
        scattered = False
        t0 = time.perf_counter()
        try:
            self._check_sender(sender, msg)
            self.guard.admit(sender, msg.slot, msg.generation)
            self.seconds["notice_check"] += time.perf_counter() - t0
        except (ProtocolError, DataPlaneError) as exc:
            self.counters[f"refused_{type(exc).__name__}"] += 1
            log.warning("rank %s: staged notice from %s refused: %s", core.ns, sender, exc)
            return  # no ACK: not a slot of this writer, or a replay of one already answered
        event = None
        try:
            scattered, event = self._scatter(msg)
        except (ProtocolError, DataPlaneError) as exc:
            self.counters[f"scatter_{type(exc).__name__}"] += 1
            log.warning("rank %s: staged chunk from %s not scattered: %s", core.ns, sender, exc)
        self.counters["scattered" if scattered else "not_scattered"] += 1
        self.seconds["notice_call"] += time.perf_counter() - t0
        if event is not None:  # a GPU scatter: ACK once it ran (`poll`)
            self._pending.append((sender, msg, event, time.perf_counter()))
            return
        self._ack(sender, msg, scattered)

    def _ack(self, sender: str, msg: StageWrite, scattered: bool) -> None:
        """Answer a notice: the writer's slot is free again (its credit)."""
        faults = self.core.faults
        if faults is not None and faults.drop_acks > 0:
            faults.drop_acks -= 1
            self.counters["acks_dropped"] += 1
            return
        t0 = time.perf_counter()
        try:
            ack = encode_stage(StageAck(slot=msg.slot, generation=msg.generation, scattered=scattered))
            if not self._send_stage(sender, ack):
                self.counters["ack_send_failed"] += 1
        except Exception as exc:
            self.counters["ack_send_failed"] += 1
            log.warning("rank %s: ACK to %s failed: %s", self.core.ns, sender, exc)
        self.seconds["ack_call"] += time.perf_counter() - t0

    def poll(self) -> bool:
        """ACK the GPU scatters that ran (in launch order: one stream). The ACK
        is what frees the writer's slot and reports the chunk DONE: it never
        comes before the scatter finished reading our slot and writing the blocks."""
        progressed = False
        while self._pending and self._pending[0][2].query():
            sender, msg, _, launched = self._pending.popleft()
            self.seconds["scatter_wait"] += time.perf_counter() - launched
            self._ack(sender, msg, True)
            progressed = True
        return progressed

    def settle(self) -> None:
        """Wait for every launched scatter (microseconds: they are queued
        kernels). Called before blocks go back to the pool: a block is never
        reused while one of our scatters may still write it."""
        if self._pending:
            self._pending[-1][2].synchronize()

    def pending(self) -> int:
        return len(self._pending)

    def _check_sender(self, sender: str, msg: StageWrite) -> None:
        cfg = self.core.config
        if not msg.ctx_rank < cfg.peer_spec.tp:
            raise DataPlaneError(f"CTX rank {msg.ctx_rank} of a TP {cfg.peer_spec.tp} instance")
        ns = RankNamespace(instance_id=cfg.peer_spec.instance_id, role=Role.CTX, rank=msg.ctx_rank)
        if sender != agent_name(cfg.deployment, ns, msg.ctx_epoch):
            raise DataPlaneError(f"a notice naming CTX rank {msg.ctx_rank} epoch {msg.ctx_epoch} from {sender}")
        if not msg.ctx_rank * self.window <= msg.slot < (msg.ctx_rank + 1) * self.window:
            raise DataPlaneError(f"slot {msg.slot} is not in CTX rank {msg.ctx_rank}'s partition")
        if not 0 < msg.max_piece <= self.arena.slot_bytes or msg.nbytes > self.arena.slot_bytes:
            raise DataPlaneError(f"a chunk of {msg.nbytes} B (pieces of {msg.max_piece} B) for slots of {self.arena.slot_bytes} B")

    def _scatter(self, msg: StageWrite) -> tuple[bool, Any]:
        """Scatter the slot into the lease of exactly msg's request, if it is
        live and installed here; False (nothing written) otherwise. With the
        CUDA event that marks the scatter's end on a GPU (None on the host,
        where it ran already)."""
        core = self.core
        parent = ParentKey(request_id=msg.request_id, ctx_attempt=msg.ctx_attempt, gen_attempt=msg.gen_attempt)
        if not core.side.may_scatter(parent):
            return False, None  # cancelled, released or quarantined: never write an ended lease
        edge = (msg.ctx_rank, core.config.rank)
        pieces = self._edge_pieces(edge, msg.max_piece)
        lease = core.pool.lease_of(parent)
        P = len(pieces)
        if not P or msg.end <= msg.start or msg.end > len(lease) * P:
            raise DataPlaneError(f"rows [{msg.start}, {msg.end}) of a lease of {len(lease)} blocks x {P} pieces")
        unit = self._units.get(pieces)
        if unit is None:
            unit = self._units[pieces] = stage_unit(pieces, 1, core.buffer.strides)
        slot = self.arena.slot(msg.slot)
        full = self._full_map(parent, edge, msg.max_piece, pieces, lease, unit)
        if full.simple:
            m: StageMap = full.rows(msg.start, msg.end)
        else:
            rows = np.arange(msg.start, msg.end, dtype=np.int64)
            blocks = lease.blocks
            m = stage_map(pieces, blocks[rows // P] * P + rows % P, 1, core.buffer, unit, slot.device)
        if m.nbytes != msg.nbytes:
            raise DataPlaneError(f"rows [{msg.start}, {msg.end}) hold {m.nbytes} B, the notice says {msg.nbytes}")
        t0 = time.perf_counter()
        scatter(core.buffer, slot, m)
        t1 = time.perf_counter()
        self.seconds["scatter_call"] += t1 - t0
        if slot.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(slot.device))
            self.seconds["scatter_event"] += time.perf_counter() - t1
            return True, event
        return True, None

    def _full_map(
        self, parent: ParentKey, edge: tuple[int, int], max_piece: int, pieces: tuple[Piece, ...], lease: Any, unit: int
    ) -> StageMap:
        """The whole lease's scatter map for one edge, once per edge session: a
        chunk's map is a slice of it."""
        key = (parent, edge, max_piece)
        full = self._maps.get(key)
        if full is None:
            P = len(pieces)
            rows = np.arange(len(lease) * P, dtype=np.int64)
            blocks = lease.blocks
            full = stage_map(pieces, blocks[rows // P] * P + rows % P, 1, self.core.buffer, unit, self.arena.tensor.device)
            if len(self._maps) > 256:
                self._maps.clear()
            self._maps[key] = full
        return full

    def prepare(self, parent: ParentKey, below: int, least: int = 0) -> None:
        """Build the scatter maps of `parent`'s edges when its lease is
        installed (before the OPENs go out), not at the first notice: for the
        edges the mode would stage, with chunks of our `chunk_bytes` (a CTX
        with other chunks gets the map built at its first notice instead).
        Never raises."""
        core = self.core
        cfg = core.config
        try:
            lease = core.pool.lease_of(parent)
            for edge in core.shards.edges_for_gen_rank(cfg.rank):
                pieces = self._edge_pieces(edge, cfg.chunk_bytes)
                if not pieces or not _stages(cfg, sum(p[4] for p in pieces) / len(pieces), below, len(lease) * len(pieces), least):
                    continue
                unit = self._units.get(pieces)
                if unit is None:
                    unit = self._units[pieces] = stage_unit(pieces, 1, core.buffer.strides)
                self._full_map(parent, edge, cfg.chunk_bytes, pieces, lease, unit)
                self.counters["maps_prepared"] += 1
        except Exception as exc:
            self.counters["map_prepare_failed"] += 1
            log.debug("rank %s: scatter maps not prepared: %r", core.ns, exc)

    def forget(self, parent: ParentKey) -> None:
        for key in [k for k in self._maps if k[0] == parent]:
            del self._maps[key]

    def stats(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "seconds": dict(self.seconds), "writers_seen": len(self.guard)}
