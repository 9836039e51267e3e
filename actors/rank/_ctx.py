"""`CtxRankCore`: the core of a CTX (prefill) rank (see its class docstring)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.actors._coordinator_errors import ParentInFlight
from kvhandoff.actors._dataplane import (
    BufferGeometry,
    Chunk,
    ChunkPlan,
    DataPlaneError,
    Piece,
    edge_pieces,
    plan_chunks,
    resolve_regions,
)
from kvhandoff.actors._names import agent_name
from kvhandoff.actors._stager import StagedWriter, staged_below, staged_min_descriptors
from kvhandoff.actors.rank._config import RankConfig, _Pair, log
from kvhandoff.actors.rank._core import RankCore
from kvhandoff.protocol import (
    MAX_LEND_BLOCKS,
    Action,
    AdmissionRefused,
    AdmissionRequest,
    BlockColumns,
    Capability,
    ContextTicket,
    CtxRank,
    Lend,
    Message,
    Negotiated,
    NegotiationOutcome,
    Open,
    ParentKey,
    PeerBuffer,
    PostChunk,
    Prepared,
    ProtocolError,
    RecentMemory,
    Role,
    RoundError,
    StageAck,
    StaleError,
    active_cancel,
    admission_verdict,
    block_columns,
    whole_block_misfits,
)
from kvhandoff.topology import TopologySpec, blocks_for_tokens, memory_pieces

#: The byte budget of a CTX rank's recent data-phase timings (`xfer`).
_TIMING_BYTES = 1 << 20


class CtxRankCore(RankCore):
    """A CTX (prefill) rank: it leases with a lease deadline and prefills on
    admission, checks every OPEN and plans its WRITE chunks, votes a parent
    prepared once every local edge is, posts the chunks of a decided parent and
    polls them to DONE or ERR (`CtxRankActor` is this class as a Ray actor).
    It runs the conservative path (a cancel waits for a decided transfer) when
    configured to, or when the agreed capabilities lack the active cancel
    protocol."""

    role = Role.CTX
    peer_role = Role.GEN
    side: CtxRank
    admits_unpaired = True

    def _remembered(self) -> dict[str, Any]:
        return {"transfer_timings": self._xfer.stats(time.monotonic())}

    def __init__(self, config: RankConfig, epoch: int, *, tensors: Sequence[torch.Tensor] | None = None) -> None:
        # The data plane: per edge ticket, its chunk plans, the GEN geometry
        # its OPEN's blocks were checked against (None: not yet, it was not
        # known at receipt; `_gen_geometry` checks them at post time) and
        # those block descriptors.
        self._chunks: dict[ContextTicket, tuple[list[ChunkPlan], BufferGeometry | None, Any]] = {}
        self._geometry: dict[str, BufferGeometry] = {}  # peer agent name -> its buffer
        self._pieces: dict[tuple[str, tuple[int, int], int], tuple[Piece, ...]] = {}
        self._in_flight: dict[tuple[ContextTicket, int], Chunk] = {}
        self._peer_agent: dict[ContextTicket, str] = {}
        # Parents with an OPEN whose GEN agent is being looked up: not voted
        # prepared until every such lookup ended (`_accept`).
        self._resolving: dict[ParentKey, int] = {}
        self._writer: StagedWriter | None = None
        # Data phase per parent: [first post, last DONE, bytes] (perf_counter), bounded.
        self._xfer: RecentMemory[ParentKey, list[float]] = RecentMemory(max_bytes=_TIMING_BYTES)
        # Pull: this incarnation's last lend number, and the parents lent
        # and not ended (a READ of ours may run while one is: `_stage_polling`).
        self._lend_seq = 0
        self._lent: set[ParentKey] = set()
        super().__init__(config, epoch, tensors=tensors)  # last: it registers this rank
        if self.arena is not None:
            below = staged_below(self.buffer.device, config.staged_below)
            least = staged_min_descriptors(self.buffer.device, config.staged_min_descriptors)
            self._writer = self._staged = StagedWriter(self, self.arena, config.staging_window, below, least)
            self._stage_takers[StageAck] = self._writer.on_ack

    # -- the role's hooks ---------------------------------------------------------------

    def _ctx_and_gen(self) -> tuple[TopologySpec, TopologySpec]:
        return self.config.spec, self.config.peer_spec

    def _stage_polling(self) -> bool:
        # A lent parent's READ progresses in our NIXL worker too (the target
        # of a one-sided READ over TCP is progressed by its own polls).
        return bool(self._lent) or (self._writer is not None and self._writer.busy()) or super()._stage_polling()

    def _make_side(self, transfer_timeout: float) -> CtxRank:
        return CtxRank(
            self.our, self.digest, self.pool, transfer_timeout=transfer_timeout,
            edges_per_parent=len(self.shards.edges_for_ctx_rank(self.config.rank)),
            conservative=self.config.conservative, quarantine_limit=self.config.quarantine_limit,
        )

    def _admit(self, request: AdmissionRequest, blocks: int, now: float, deadline: float, pair: _Pair | None) -> None:
        # This parent's edges here: as many as the GEN instance it pairs with
        # gives us (bound at its first OPEN when that is not known yet).
        edges = len(pair.shards.edges_for_ctx_rank(self.config.rank)) if pair is not None else None
        self.side.admit(request.parent, blocks, now=now, lease_deadline=deadline, blocks=request.blocks, edges=edges)

    def _admitted(self, parent: ParentKey, now: float) -> None:
        if self.config.synthetic:
            self._prefill(parent)
        self._perform(self.side.prefilled(parent))

    async def publish_alone(self, request: AdmissionRequest) -> bool | Lend:
        """An engine's published request, leased on this rank alone with no
        coordinator round: for a CTX instance of one rank whose GEN peer is
        one rank too (its GEN rank receives alone, and its OPEN, bound here,
        is the claim: nothing at a coordinator waits for the parent; docs/
        design.md "Engines"). Leases exactly the engine's ``request.blocks``
        as a vote does, records the admission and pushes the report at once,
        so the coordinator has the parent in flight before anything else of
        it (a cancel it got earlier is kept until that report comes). Returns
        the `Lend` when the parent was lent to the GEN rank (pull: `_lend`),
        True when it waits for the GEN rank's OPEN (push), False when refused
        (no room or a block still held, the admission stop, a draining
        instance, a rank not taken into its coordinator's rounds): nothing
        is held. Raises `RoundError` on a rank of several and
        `ParentInFlight` for a parent already here."""
        parent = request.parent
        if self.trace.every:
            self.trace.record(parent.request_id, "publish_alone", "call", "client")
        if self.config.spec.tp != 1:
            raise RoundError(f"rank {self.ns}: a publish at the rank needs a one-rank instance")
        if self.side.is_admitted(parent) or parent in self.side.parents():
            raise ParentInFlight(f"parent {parent!r} is already pending or in flight")
        now = time.monotonic()
        if (
            not self.member.joined
            or self._admission_closed
            or not self._lease_for(request, now, now + self.config.lease_timeout_s, self.side.admission_stopped())
        ):
            self.counters["published_alone_refused"] += 1
            return False
        self.counters["published_alone"] += 1
        self.member.follower.record_admitted(parent)
        self._nudge()  # the coordinator learns it before any later news of it
        self._admitted(parent, now)
        self._ensure_polling()  # its lease deadline ticks in the poll loop
        lend = self._lend(parent, now) if self.config.pull else None
        return True if lend is None else lend

    def _lend(self, parent: ParentKey, now: float) -> Lend | None:
        """Pull: lend the published `parent`'s blocks to the pair's one GEN
        rank as it is known now (its incarnation), before the ticket leaves
        (`CtxRank.lend`: DECIDED at once; the blocks come back on the
        reader's word, its confirmed death, or the answer to our FENCE at
        the lease's end). None, and the parent waits for an OPEN (push),
        where the pair did not agree on pull, its GEN instance is not one
        rank, its GEN rank is not known yet, the lease is longer than a
        ticket carries, or the edge would be staged (pull READs direct)."""
        pair = self._pairs.get(self._default_peer)
        if (
            pair is None
            or not self._lend_key
            or pair.spec.tp != 1
            or not isinstance(pair.negotiation, Negotiated)
            or not pair.negotiation.supports(Capability.PULL)
        ):
            return None
        found = self._peer_handles.get((pair.instance, 0))
        lease = self.pool.lease_of(parent)
        edge = (self.config.rank, 0)
        if found is None or len(lease) > MAX_LEND_BLOCKS:
            self.counters["pushed_not_lent"] += 1
            return None
        pieces = self._edge_pieces(edge, None, pair.instance)
        if self._writer is not None and self._writer.wants_pieces(pieces, len(lease) * len(pieces)):
            self.counters["pushed_staged"] += 1
            return None
        gen = found[0]
        ticket = ContextTicket(
            request_id=parent.request_id,
            ctx_attempt=parent.ctx_attempt,
            gen_attempt=parent.gen_attempt,
            ctx=self.our,
            gen=gen,
            ctx_digest=self.digest,
            gen_digest=pair.gen_digest,
        )
        self._lend_seq += 1
        nbytes = pair.shards.edge_bytes_per_block(edge) * len(lease)
        try:
            actions = self.side.lend(parent, {ticket: nbytes}, lend_seq=self._lend_seq, now=now)
        except ProtocolError as exc:  # nothing changed: it waits for an OPEN
            self.counters[f"lend_refused_{type(exc).__name__}"] += 1
            return None
        self.counters["lent"] += 1
        self._lent.add(parent)
        self._perform(actions)
        return Lend.seal(
            self._lend_key, parent,
            ctx_epoch=self.our.epoch, gen_epoch=gen.epoch, seq=self._lend_seq, blocks=Lend.pack(lease.blocks),
        )

    def _decided(self, parent: ParentKey, now: float) -> None:
        self._perform(self.side.decided(parent, now))

    def _negotiated(self, outcome: NegotiationOutcome) -> None:
        # The active cancel protocol runs only if the agreed capabilities carry
        # it, with every pair agreed so far (one flag for the rank: the safe
        # side when pairs differ).
        agreed = [p.negotiation for p in self._pairs.values() if isinstance(p.negotiation, Negotiated)] or [outcome]
        self.side.conservative = self.config.conservative or not all(active_cancel(o) for o in agreed)

    def _conservative(self) -> bool:
        return self.side.conservative

    def _learn_agent(self, name: str, metadata: Any, geometry: BufferGeometry) -> None:
        if name not in self.transport.peers:
            self.transport.add_peer(metadata)
            self._geometry[name] = geometry

    def _receive(self, message: Message, now: float) -> list[Action]:
        """An OPEN is checked with what only a CTX rank knows (chunk plan, the
        GEN agent's name and registered buffer); any other frame as the base does."""
        if not isinstance(message, Open):
            return super()._receive(message, now)
        again = self.side.open_again(message)
        if again is not None:
            return again  # a GEN rank asks about an edge we hold: nothing new to check
        # The protocol checks the OPEN (lease size, block size, the sender's
        # own agent, whole blocks of its registered buffer when the directory
        # gave us that) before it records anything.
        gen = message.ticket.gen
        pair = self._pairs[gen.ns.instance_id]  # `_pair_for` found it
        # The OPEN names the GEN instance exactly as the pair knows it (S3):
        # another GEN digest is a stale or forged proposal.
        if message.ticket.gen_digest != pair.gen_digest:
            raise StaleError("gen topology digest", message.ticket.gen_digest.hex(), pair.gen_digest.hex())
        parent = message.ticket.parent
        paired = self._pair_of.get(parent)
        if paired is not None and paired != gen.ns.instance_id:
            raise StaleError("gen instance", gen.ns.instance_id, paired)
        binding = paired is None and self.config.fleet and self.pool.holds(parent)
        if binding:
            # A published parent's first OPEN names the GEN instance that
            # claimed it (a ticket is claimed once, by one instance): bind
            # the parent to that pair; undone if this OPEN is refused.
            self.side.bind_edges(parent, len(pair.shards.edges_for_ctx_rank(self.config.rank)))
            self._pair_of[parent] = gen.ns.instance_id
        if self.config.admit_at_open and parent not in self.side.parents():
            return self._admit_at_open(message, pair, now)
        try:
            return self._receive_open(message, pair, now)
        except ProtocolError:
            if binding and self.side.unbind_unopened(parent):
                self._pair_of.pop(parent, None)
            raise

    def _admit_at_open(self, message: Open, pair: _Pair, now: float) -> list[Action]:
        """The parent's first OPEN on a rank that admits at the OPEN: the
        same verdict as a vote (paired, negotiated, not stopped), then the
        protocol admits and records it in one step (a refusal changes
        nothing: the caller answers a REJECT), the synthetic prefill, and
        the admission in our next report."""
        parent = message.ticket.parent
        # What a coordinator's round would refuse: nothing is admitted by an
        # incarnation its coordinator has not taken into its rounds yet (at
        # start, or after a restart: `round_join`), nor once the instance
        # drains (`close_admission`; no coordinator round is left to refuse it).
        if not self.member.joined or self._admission_closed:
            why = "not_joined" if not self.member.joined else "draining"
            self.counters[f"refused_at_open_{why}"] += 1
            raise AdmissionRefused(f"admission at the OPEN refused: {why}")
        verdict = admission_verdict(
            stopped=self.side.admission_stopped(),
            peer=pair.instance,
            paired=True,
            left=pair.left,
            admits_unpaired=self.admits_unpaired,
            negotiation=pair.negotiation,
        )
        if not verdict.admit:
            self.counters[verdict.refusal] += 1
            raise AdmissionRefused(f"admission at the OPEN refused: {verdict.refusal}")
        n = blocks_for_tokens(self.config.layout, message.num_tokens)
        edges = len(pair.shards.edges_for_ctx_rank(self.config.rank))
        actions = self._receive_open(message, pair, now, admit=(n, now + self.config.lease_timeout_s, edges))
        self.counters["admitted_at_open"] += 1
        self._tokens[parent] = message.num_tokens
        self._pair_of[parent] = pair.instance
        if self.config.synthetic:
            self._prefill(parent)
        # No report of its own: nothing waits on it, and every admitted
        # parent makes news later (its completion, a cancel, a failure, the
        # lease's end), whose report carries this too (reports are whole).
        self.member.follower.record_admitted(parent)
        return actions

    def _receive_open(
        self, message: Open, pair: _Pair, now: float, admit: tuple[int, float, int] | None = None
    ) -> list[Action]:
        """Record the OPEN (`admit`: (blocks, lease deadline, edges) to admit
        its parent with it, `CtxRank.admit_at_open`)."""
        gen = message.ticket.gen
        cols = block_columns(message.buffer)
        geometry = self._geometry.get(message.buffer.agent_name)
        peer = None
        if geometry is not None:
            peer = PeerBuffer(
                message.buffer.agent_name, geometry.base, geometry.block_bytes, geometry.num_blocks,
                block_stride=geometry.region_table()[0][1],
            )
        checks = {
            "expected_agent": agent_name(self.config.deployment, gen.ns, gen.epoch),
            "block_bytes": pair.shards.gen_block_bytes,
            "peer": peer,
        }
        if admit is None:
            chunks = self._plan_chunks(message, pair, cols)
            actions = self.side.receive_open(message, now, num_chunks=len(chunks), **checks)
        else:
            # The plan pairs our lease's blocks with the OPEN's, and the lease
            # comes with the admission: count the chunks first (the count
            # depends on sizes only), plan them once the blocks are ours.
            n_blocks, deadline, edges = admit
            count = len(self._plan_chunks(message, pair, cols, lease=np.zeros(n_blocks, np.int64)))
            actions = self.side.admit_at_open(
                message, n_blocks, now=now, lease_deadline=deadline, edges=edges, num_chunks=max(count, 1), **checks
            )
            chunks = self._plan_chunks(message, pair, cols)
        self._chunks[message.ticket] = (chunks, geometry, cols)
        self._peer_agent[message.ticket] = message.buffer.agent_name
        if self._writer is not None and chunks:
            self._writer.prepare(message.ticket)  # off the data phase: before READY
        return actions

    async def _accept(self, message: Message, actions: list[Action]) -> None:
        """Perform the actions, but vote `Prepared` only once the GEN agent is known."""
        prepared = [a for a in actions if isinstance(a, Prepared)]
        self._perform([a for a in actions if not isinstance(a, Prepared)])
        # "Prepared" means able to post: an OPEN from an agent we do not know
        # yet (the GEN, or we, restarted) is voted prepared only once the
        # directory gave us that agent. Voting first let a fast decide round
        # post to an unknown agent: the chunk failed and the request was
        # cancelled. The session itself was installed above, before any
        # await, so frames that follow (CANCEL) still find it; the protocol's
        # `Prepared` is performed after the await.
        # A parent can also become prepared elsewhere while we await (another
        # edge's OPEN, from an agent known already or looked up faster): it
        # is not voted while any of its lookups runs, and the last one to
        # end votes it (`_record_prepared` checks it is still prepared).
        parents = {action.parent for action in prepared}
        if isinstance(message, Open) and message.buffer.agent_name not in self.transport.peers:
            parent = message.ticket.parent
            self._resolving[parent] = self._resolving.get(parent, 0) + 1
            try:
                await self._peer(message.ticket.gen)
            except Exception as exc:  # unresolvable now: the post fails, typed, and ends it
                self.counters["peer_lookup_failed"] += 1
                log.warning("rank %s: cannot resolve %s: %r", self.ns, message.ticket.gen, exc)
            finally:
                left = self._resolving.pop(parent) - 1
                if left:
                    self._resolving[parent] = left
            parents.add(parent)
        for parent in parents:
            self._record_prepared(parent)

    def _perform_role(self, action: Action, now: float) -> list[Any]:
        match action:
            case PostChunk(ticket=ticket, index=index):
                self._post(ticket, index, now)
            case Prepared(parent=parent):
                self._record_prepared(parent)
        return []

    def _poll_chunks(self, now: float) -> bool:
        """Poll posted chunks to DONE/ERR and report each to the protocol."""
        progressed = self._poll_posted(self._in_flight, now, self._timed)
        if self._writer is not None and self._writer.poll(now):
            progressed = True
        if progressed and any(p.left for p in self._pairs.values()):
            self._drop_left_pairs()  # a pair kept loaded for a WRITE may go now
        return progressed

    def _timed(self, ticket: ContextTicket, chunk: Chunk) -> None:
        """A WRITE of `ticket` polled DONE: the parent's data phase (`xfer`)."""
        timing = self._xfer.get(ticket.parent)
        if timing is not None:
            timing[1] = time.perf_counter()
            timing[2] += chunk.nbytes

    def _chunks_in_flight(self) -> int:
        return len(self._in_flight) + (self._writer.in_flight() if self._writer is not None else 0)

    def _writing_to(self, instance: str) -> bool:
        if any(ticket.gen.ns.instance_id == instance for ticket, _ in self._in_flight):
            return True
        return self._writer is not None and self._writer.writing_to(instance)

    def _forget(self, parent: ParentKey) -> None:
        self._lent.discard(parent)
        for ticket in [t for t in self._chunks if t.parent == parent]:
            del self._chunks[ticket]
            self._peer_agent.pop(ticket, None)
            if self._writer is not None:
                self._writer.forget(ticket)

    def _tracking(self) -> int:
        return len(self._chunks) + len(self._peer_agent) + len(self._lent)

    # -- OPENs, chunk plans, prepared ---------------------------------------------------

    def _edge_pieces(
        self, edge: tuple[int, int], chunk_bytes: int | None = None, peer: str | None = None
    ) -> tuple[Piece, ...]:
        """`edge`'s per-block pieces toward GEN instance `peer` (None: the
        default pair), at most one chunk each (cached per pair and chunk size)."""
        size = chunk_bytes or self.config.chunk_bytes
        instance = peer or self._default_peer
        key = (instance, edge, size)
        pieces = self._pieces.get(key)
        if pieces is None:
            pair = self._pairs[instance]
            segments = memory_pieces(pair.shards, edge, self.config.memory_kind, pair.peer_kind)
            pieces = self._pieces[key] = edge_pieces(segments, size)
        return pieces

    def _ticket_pieces(self, ticket: ContextTicket, chunk_bytes: int | None = None) -> tuple[Piece, ...]:
        return self._edge_pieces(ticket.edge, chunk_bytes, ticket.gen.ns.instance_id)

    def _pair_left(self, instance: str) -> None:
        for key in [k for k in self._pieces if k[0] == instance]:
            del self._pieces[key]
        prefix = f"{self.config.deployment}.{instance}."
        for name in [n for n in self._geometry if n.startswith(prefix)]:
            del self._geometry[name]

    def _plan_chunks(
        self, message: Open, pair: _Pair, cols: BlockColumns, lease: np.ndarray | None = None
    ) -> list[ChunkPlan]:
        """The WRITE chunks of one edge: our lease's blocks (`lease`: these
        block ids instead, for a count before the lease exists) paired, in
        order, with the OPEN's GEN block addresses. Whether those may be
        written at all is the protocol's check (`CtxRank.receive_open`, right
        after this); a plan for an OPEN it refuses is dropped. An edge the
        shard map does not have is refused here (`UnknownEdgeError`, typed)."""
        ticket = message.ticket
        if lease is None:
            if ticket.ctx != self.our or not self.pool.holds(ticket.parent):
                # The protocol refuses it with a precise error (stale, unknown).
                return [ChunkPlan((), np.zeros(0, np.int32), np.zeros(0, np.int32), 0)]
            lease = self.pool.lease_of(ticket.parent).blocks
        # Block indices only: the addresses come from the GEN's registered
        # regions at post time (`_gen_geometry`), the OPEN's are checked against them.
        n = min(len(lease), len(cols.blocks))  # unequal: the protocol refuses the OPEN right after
        pairs = np.empty((n, 2), dtype=np.int64)
        pairs[:, 0] = lease[:n]
        pairs[:, 1] = cols.blocks[:n]
        pieces = self._edge_pieces(ticket.edge, None, pair.instance)
        return plan_chunks(pieces, pairs, self._plan_bytes(pieces, message.buffer.agent_name, n * len(pieces)))

    def _plan_bytes(self, pieces: tuple[Piece, ...], peer: str, descriptors: int | None = None) -> int:
        """The chunk size of an edge with `pieces` toward `peer`: a staging
        slot (ours, or the peer's if smaller) where the mode stages it, else
        `chunk_bytes`. A chunk planned as a slot that is posted direct after
        all (no usable slot at post time) is still correct, only larger."""
        if self._writer is None or self.arena is None or not pieces:
            return self.config.chunk_bytes
        geometry = self._geometry.get(peer)
        slot = self.arena.slot_bytes
        if geometry is not None:
            if not geometry.staging:
                return self.config.chunk_bytes
            slot = min(slot, geometry.staging[1])
        if not self._writer.wants_pieces(pieces, descriptors) or slot < max(p[4] for p in pieces):
            return self.config.chunk_bytes
        return slot

    def _record_prepared(self, parent: ParentKey) -> None:
        """Perform the protocol's `Prepared`: vote the parent prepared, unless it
        stopped being prepared while we awaited its GEN agent (a CANCEL came)."""
        if not self.side.is_prepared(parent):
            return
        if parent in self._resolving:
            self.counters["prepared_awaiting_agent"] += 1
            return  # the last of its agent lookups votes it (`_accept`)
        if self.config.spec.tp == 1:
            # The only rank of its instance is the whole intersection a decide
            # round would take: decide here, one report and one apply fewer on
            # the handoff's path. A cancel the coordinator decides later finds
            # the parent DECIDED, exactly as one decided in the round before.
            self.counters["decided_alone"] += 1
            self._decided(parent, time.monotonic())
            self._ensure_polling()
            return
        self.member.record_prepared(parent)
        self._nudge()

    # -- synthetic prefill (S2) ---------------------------------------------------------

    def _prefill(self, parent: ParentKey) -> None:
        lease = self.pool.lease_of(parent)
        self.buffer.write_blocks(lease.block_list(), self._pattern(parent, self.config.rank, len(lease)))

    # -- the data plane -------------------------------------------------------------------

    def _prepared_lists(self, peer: str, ticket: ContextTicket, geometry: BufferGeometry | None) -> Any:
        """The prepared descriptor lists toward `peer` for `ticket`'s edge, or None for
        the built path (turned off, or the OPEN was not checked against a known buffer)."""
        if not self.config.prepared_descriptors or geometry is None:
            return None
        try:
            return self.transport.prepare(peer, self._ticket_pieces(ticket), geometry)
        except DataPlaneError as exc:
            # Same bytes either way: fall back to descriptors built per chunk.
            self.counters["prepare_failed"] += 1
            log.warning("rank %s: %s; posting built descriptors", self.ns, exc)
            return None

    def _post(self, ticket: ContextTicket, index: int, now: float) -> None:
        plans, _, _ = self._chunks[ticket]
        if ticket.parent not in self._xfer:
            self._xfer.remember(ticket.parent, [time.perf_counter(), 0.0, 0], now)  # before the post
        peer = self._peer_agent[ticket]
        try:
            geometry = self._gen_geometry(ticket, peer)
            plan = plans[index]
            if (
                self._writer is not None
                and self._writer.wants(self._ticket_pieces(ticket), geometry, sum(len(pl.local) for pl in plans))
                and self._writer.post(ticket, index, plan, peer, geometry, now)
            ):
                return
            prepared = self._prepared_lists(peer, ticket, geometry)
            if prepared is None:
                plan = resolve_regions(
                    plan, self._ticket_pieces(ticket), self.buffer.region_table(), geometry.region_table()
                )
            self.counters["posts_prepared" if prepared is not None else "posts_built"] += 1
            chunk = self.transport.post(peer, plan, prepared=prepared)
        except Exception as exc:  # nothing was posted: the chunk failed before DMA
            log.warning("rank %s: post failed: %r", self.ns, exc)
            self._perform(self.side.chunk_failed(ticket, index, now))
            return
        self._in_flight[(ticket, index)] = chunk
        self._ensure_polling()

    def _gen_geometry(self, ticket: ContextTicket, peer: str) -> BufferGeometry:
        """The GEN's registered regions as known now (post time), for `ticket`'s
        OPEN; the OPEN's blocks are checked against them if they were not at
        receipt. `DataPlaneError` (the chunk fails before any DMA) if unknown
        or not what the OPEN and our plan assume."""
        _, checked, cols = self._chunks[ticket]
        geometry = self._geometry.get(peer)
        if geometry is None:
            raise DataPlaneError(f"the registered regions of {peer!r} are not known")
        pair = self._pairs.get(ticket.gen.ns.instance_id)
        if pair is None:
            raise DataPlaneError(f"GEN instance {ticket.gen.ns.instance_id!r} left the fleet")
        if geometry.kind != pair.peer_kind:
            raise DataPlaneError(f"{peer!r} has memory kind {geometry.kind!r}, the plan is for {pair.peer_kind!r}")
        if checked is None:
            base, stride = geometry.region_table()[0]
            wrong = whole_block_misfits(cols, geometry.num_blocks, geometry.block_bytes, base, stride)
            if wrong is not None:
                block, addr = int(cols.blocks[wrong]), int(cols.addrs[wrong])
                raise DataPlaneError(f"OPEN block {block} at {addr:#x} is not a block of {peer}'s registered regions")
            self._chunks[ticket] = (self._chunks[ticket][0], geometry, cols)  # checked once
        return geometry

    # -- what the staged writer calls (actors/_stager.py `WriterHost`) -------------------

    #: `_edge_pieces` under the name the staged writer calls it by (in this
    #: module's functions, `edge_pieces` is still actors/_dataplane.py's).
    edge_pieces = _edge_pieces

    def chunk_plans(self, ticket: ContextTicket) -> list[ChunkPlan]:
        """The WRITE chunks planned for `ticket`'s edge at its OPEN (`_plan_chunks`)."""
        return self._chunks[ticket][0]

    @property
    def xfer(self) -> RecentMemory[ParentKey, list[float]]:
        """The data phase per parent, [first post, last DONE, bytes] (the bench reads it)."""
        return self._xfer

