"""`GenRankCore`: the core of a GEN (decode) rank (see its class docstring)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.actors._channel import carried_by
from kvhandoff.actors._coordinator_errors import ParentInFlight
from kvhandoff.actors._member import VoteNews
from kvhandoff.actors._pattern import POISON
from kvhandoff.actors._stager import StagedReader, staged_below, staged_min_descriptors
from kvhandoff.actors._trace import SENT
from kvhandoff.actors.rank._config import RankConfig, _loop_running, _Pair, log
from kvhandoff.actors.rank._pull import _PullReader
from kvhandoff.protocol import (
    ADMISSION_REFUSALS,
    Action,
    AdmissionRequest,
    BlockDescriptor,
    BlockRefs,
    BlockRuns,
    BufferInfo,
    Capability,
    ContextTicket,
    DecodeReady,
    Endpoint,
    GenEdgeSpec,
    GenRank,
    Lend,
    LocalOutcome,
    MemoryKind,
    Message,
    Negotiated,
    ParentKey,
    PostChunk,
    ProtocolError,
    RankReport,
    Reject,
    Role,
    RoundDecision,
    RoundError,
    RoundProposal,
    StageWrite,
    active_cancel,
    pack_blocks,
    pack_runs,
)
from kvhandoff.topology import TopologySpec

#: Leases of at least this many blocks are described as runs where the pair
#: negotiated them (`Capability.BLOCK_RUNS`). Below it the packed form is
#: small anyway (24 KiB at most) and cheaper to build and read (~50 us less
#: per OPEN of a few blocks, measured on the 2-core box).
RUNS_FROM_BLOCKS = 1024


class GenRankCore(_PullReader):
    """A GEN (decode) rank: it leases with a deadline on admission and, once
    both instances admitted, installs the parent and sends an OPEN on each of
    its edges; it verifies every byte of a settled parent before voting it
    complete (S2), returns decode-ready KV on `free` (or at once, when the
    submission asked for it), and poisons every block it releases
    (`GenRankActor` is this class as a Ray actor)."""

    role = Role.GEN
    peer_role = Role.CTX
    side: GenRank

    def __init__(self, config: RankConfig, epoch: int, *, tensors: Sequence[torch.Tensor] | None = None) -> None:
        # Admitted parents whose blocks go back once decode-ready and verified.
        self._release_when_ready: set[ParentKey] = set()
        # Bytes verified per parent, until it is released (`free` answers them).
        self._verified: dict[ParentKey, int] = {}
        # Work an apply leaves for after it (`_later`), in order.
        self._deferred: list[tuple[Any, tuple[Any, ...]]] = []
        self._reader: StagedReader | None = None
        # Parents received at this rank (`receive_alone`), until they end.
        self._received_here: set[ParentKey] = set()
        # Of those, the one completing alone in this `_perform` step: the
        # rank answers its caller, so its completion report may wait.
        self._answered_here: set[ParentKey] = set()
        super().__init__(config, epoch, tensors=tensors)  # last: it registers this rank
        if self.arena is not None:
            self._reader = self._staged = StagedReader(self, self.arena, config.staging_window)
            self._stage_takers[StageWrite] = self._reader.on_write

    def _stage_polling(self) -> bool:
        # A WRITE may land while a parent is installed, cancelling or
        # quarantined: the target's worker progresses meanwhile.
        return (
            super()._stage_polling()
            or (self._reader is not None and self._reader.pending() > 0)
            or self.side.may_be_written()
        )

    def _poll_chunks(self, now: float) -> bool:
        # Our READs (pull) to DONE or ERR; GPU scatters that ran are ACKed
        # here (the writer's credits).
        progressed = self._poll_posted(self._read_flight, now)
        return (self._reader is not None and self._reader.poll()) or progressed

    def _chunks_in_flight(self) -> int:
        return len(self._read_flight) + (self._reader.pending() if self._reader is not None else 0)

    # -- the role's hooks ---------------------------------------------------------------

    def _ctx_and_gen(self) -> tuple[TopologySpec, TopologySpec]:
        return self.config.peer_spec, self.config.spec

    def _make_side(self, transfer_timeout: float) -> GenRank:
        return GenRank(
            self.our, self.digest, self.pool, transfer_timeout=transfer_timeout,
            consume_timeout=self.config.consume_timeout_s, quarantine_limit=self.config.quarantine_limit,
        )

    def _admit(self, request: AdmissionRequest, blocks: int, now: float, deadline: float, pair: _Pair) -> None:
        self.side.admit(request.parent, blocks, now=now, deadline=deadline, blocks=request.blocks)
        if request.release_when_ready:
            self._release_when_ready.add(request.parent)

    async def admit_alone(
        self,
        request: AdmissionRequest,
        epoch: int | None = None,
        applied: int = 0,
        decision: RoundDecision | None = None,
    ) -> tuple[bool, RankReport | None]:
        """Admit ``request`` as the GEN instance's only rank, with no round:
        its coordinator hands it a submission whose CTX instance admits at
        the OPEN (docs/design.md "Admission at the OPEN"). The verdict and
        lease of a vote, then what an applied admission does (install, send
        the OPENs), and `record_admitted`. Returns whether it admitted, and
        this rank's report, which the leader takes in before it hears
        anything else of the parent (a cancel the caller sends next finds it
        in flight). Refused: nothing is held. Raises `StaleEpochError` for
        another incarnation and `RoundError` for a rank of several or one
        its coordinator has not taken into its rounds (nothing changes).
        ``applied``: the last round its coordinator decided; the admission
        waits until that decision is applied here (bounded), so the blocks
        a completion returns are free for it, as for a vote its apply rides
        with. ``decision``, when given, is the last one decided, riding with
        this call instead of going alone: applied first, in its turn, as
        `round_vote` applies the one riding with it."""
        if self.trace.every:
            self.trace.record(request.parent.request_id, "admit_alone", carried_by(), self._coordinator_actor)
        self.member._check(epoch)
        if decision is not None:
            await self.member.round_apply(decision, epoch)
        else:
            await self.member.wait_applied(applied)
        self.member._check(epoch)
        if self.config.spec.tp != 1 or not self.member.joined:
            raise RoundError(f"rank {self.ns}: admission alone needs the joined rank of a one-rank instance")
        self._run_deferred()  # what the last apply returned is free to lease
        now = time.monotonic()
        if self.side.is_admitted(request.parent) or request.parent in self.side.parents():
            raise RoundError(f"rank {self.ns}: {request.parent!r} is admitted here already")
        if not self._lease_for(request, now, now + self.config.lease_timeout_s, self.side.admission_stopped()):
            return False, None
        self.counters["admitted_alone"] += 1
        self.member.follower.record_admitted(request.parent)
        self._admitted(request.parent, now)
        return True, self.member.report()

    async def receive_alone(
        self, request: AdmissionRequest, timeout: float, lend: Lend | None = None
    ) -> tuple[str, bool]:
        """One handoff into a one-rank GEN instance, driven by this rank from
        its client's call to its end, with no coordinator on the way (docs/
        design.md "Engines": a receive at the rank). For a submission paired
        with a CTX instance that binds a published parent at its first OPEN
        (`Coordinator.binds_at_first_open`): the OPEN is the claim.

        Admits as `admit_alone` does (the vote's verdict and lease, install,
        the OPENs, `record_admitted`), pushes the report at once, so the
        coordinator has the parent in flight before anything else of it
        (a cancel it got earlier waits for that report), then waits for the
        parent's local outcome and for its blocks to be back in the pool.
        With ``lend`` (the ticket's: the CTX rank lent its blocks to this
        rank at publish) it READs them itself instead (docs/design.md
        "Pull"): no OPEN, no frame before the bytes; the lend is checked
        first (this incarnation, that CTX incarnation, whole blocks of its
        registered buffer, never read or fenced here before) and a lend it
        refuses ends the receive "rejected" and is answered at once, so the
        lender gets its blocks back.

        Returns ``(outcome, returned)``: "completed" as soon as the last
        TERMINAL made it decode-ready with every byte verified; any other
        outcome once the coordinator's decision ended it here (``returned``
        False at once when its blocks were quarantined); "timeout"
        past ``timeout`` (the caller cancels it). Refused, nothing held:
        "rejected" (no room, the admission stop, draining, or a parent this
        rank already ended); `ParentInFlight` for a parent under way here;
        `RoundError` for a rank of several, or one not joined."""
        started = self.receive_at_once(request, timeout, lend)
        return started if isinstance(started, tuple) else await started

    def receive_at_once(
        self, request: AdmissionRequest, timeout: float, lend: Lend | None = None
    ) -> tuple[str, bool] | Coroutine[Any, Any, tuple[str, bool]]:
        """`receive_alone` as far as it goes within this call, on this rank's
        loop (an engine's front end beside its decode worker calls it there):
        its answer if the receive ended (refused, or a pull whose READs ended
        within `RankConfig.read_spin_s`, its blocks back), else the coroutine
        that waits for the rest (await it). An engine's thread waits for this
        answer between its steps, and every turn of the loop on the way is a
        wait for the GIL while the engine computes (docs/vllm.md): a pulled
        receive that ends here takes none."""
        parent = request.parent
        if self.trace.every:
            self.trace.record(parent.request_id, "receive_alone", "call", "client")
        if self.config.spec.tp != 1 or not self.member.joined:
            raise RoundError(f"rank {self.ns}: a receive at the rank needs the joined rank of a one-rank instance")
        if self.side.is_admitted(parent) or parent in self.side.parents() or parent in self._waiters:
            raise ParentInFlight(f"parent {parent!r} is already pending or in flight")
        self._run_deferred()  # what the last apply returned is free to lease
        now = time.monotonic()
        # A parent ended here is refused by the protocol's memory of released
        # owners too; its outcome, still remembered, would answer the wait.
        if (
            self._admission_closed
            or parent in self._outcome
            or not self._lease_for(request, now, now + self.config.lease_timeout_s, self.side.admission_stopped())
        ):
            self.counters["received_alone_refused"] += 1
            return "rejected", True
        self.counters["received_alone"] += 1
        self._received_here.add(parent)
        if lend is not None:
            self._lend_of[parent] = lend
        self.member.follower.record_admitted(parent)
        # The coordinator learns it before any later news of it. A pull's
        # report rides with its completion's (`lazy`): its Ray call would
        # take this loop's time while the READ runs (measured: docs/vllm.md).
        self._nudge(lazy=lend is not None)
        self._admitted(parent, now)
        if lend is not None and self._spin_reads(parent):
            self._run_deferred()  # a completion's return of the blocks (`_free_unconsumed`)
            if parent in self._outcome and self.side.at_rest(parent) and not self.pool.holds(parent):
                self.counters["received_at_once"] += 1
                self._answering(parent)
                return str(self._outcome[parent]), True
        return self._end_alone(parent, timeout)

    async def _end_alone(self, parent: ParentKey, timeout: float) -> tuple[str, bool]:
        start = time.monotonic()
        outcome = await self.wait(parent, timeout)
        if self.pool.is_quarantined(parent):
            self._answering(parent)
            return str(outcome), False  # held until a proof of quiescence reclaims them
        back = await self.returned(parent, max(timeout - (time.monotonic() - start), 0.0))
        self._answering(parent)
        return str(outcome), back

    def _answering(self, parent: ParentKey) -> None:
        """Mark, in a sampled trace, that this rank answers its client now:
        the client's outcome follows this mark, not a later event here."""
        if self.trace.every:
            self.trace.record(parent.request_id, f"{SENT}outcome", "local")


    def _admitted(self, parent: ParentKey, now: float) -> None:
        # Admitted by both instances (the CTX ranks applied theirs before this
        # decision was made): install and send OPENs now. No READY can come
        # before every GEN rank did: a CTX rank is prepared only with an OPEN
        # from each of its edges' GEN ranks.
        self._open(parent, now)
        if _loop_running():
            self._ensure_polling()  # WRITEs will come: progress the worker

    def _conservative(self) -> bool:
        return self.config.conservative or not active_cancel(self._negotiation)

    def _receive(self, message: Message, now: float) -> list[Action]:
        """A REJECT by which the CTX refused to admit the parent at its OPEN
        (no room, admission stopped or draining) fixes this rank's local
        outcome as "rejected" before the cancel it starts settles it: the
        client's handoff is then "rejected", as when a round refuses it. So
        does any REJECT of a parent received at this rank: its OPEN was the
        claim, refused (the ticket ended, or another GEN instance bound it)."""
        actions = super()._receive(message, now)
        refused = isinstance(message, Reject) and (
            message.reason in ADMISSION_REFUSALS or message.ticket.parent in self._received_here
        )
        if refused:
            self._outcome.setdefault(message.ticket.parent, LocalOutcome.REJECTED, time.monotonic())
        return actions

    def _perform_role(self, action: Action, now: float) -> list[Any]:
        match action:
            case PostChunk(ticket=ticket, index=index):
                self._post_read(ticket, index, now)
            case DecodeReady(parent=parent):
                release = parent in self._release_when_ready
                if self.pool.holds(parent):  # the bytes that landed here (metrics)
                    self.counters["bytes_received"] += len(self.pool.lease_of(parent)) * self.block_bytes
                self._outcome.remember(parent, action.outcome, now)
                self._finish(parent, action.outcome)
                if release:
                    # Nobody consumes it (the submission said so): verified,
                    # return it, once the decision's apply has answered.
                    self._later(self._free_unconsumed, parent)
        return []

    def _completing(self, parent: ParentKey, now: float) -> list[Any]:
        """As a rank alone completes (`_completing` of the base): decode-ready
        here, now, and a parent nobody consumes goes back to the pool when
        this turn ends (`_later`, as after an apply: freeing it here too
        would be a second release). A parent this rank received itself is
        answered here (`receive_alone`): its report may wait."""
        # Asked first: the completion's perform ends the parent's bookkeeping
        # here (`_finish` -> `_forget`), `_received_here` included.
        received = parent in self._received_here
        actions = super()._completing(parent, now)
        if received and parent in self._completed_alone:
            self._answered_here.add(parent)
        return actions

    def _completion_can_wait(self, parent: ParentKey) -> bool:
        """A parent received at this rank and completed alone: the rank
        answers its caller (`receive_alone`), so its completion report waits
        `lazy_flush_s` for other news instead of going out ahead of that
        answer; the coordinator's decision only settles its bookkeeping."""
        if parent in self._answered_here:
            self._answered_here.discard(parent)
            return True
        return False

    def _later(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` once the apply in progress has ended: when this
        turn of the event loop ends, or before a vote that follows in the
        same call (a decision riding with the next proposal: the blocks it
        returns must be free for that vote)."""
        if not _loop_running():
            fn(*args)
            return
        self._deferred.append((fn, args))
        if len(self._deferred) == 1:
            asyncio.get_running_loop().call_soon(self._run_deferred)

    def _run_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for fn, args in deferred:
            fn(*args)

    def _vote(self, proposal: RoundProposal) -> VoteNews:
        self._run_deferred()  # what the decision applied in this call returns is free to lease
        return super()._vote(proposal)

    def _free_unconsumed(self, parent: ParentKey) -> None:
        """Return a decode-ready request nobody consumes (release_when_ready)."""
        try:
            actions = self.side.free(parent)
        except ProtocolError:
            return  # freed meanwhile (a client free, the consumer deadline)
        self._perform(actions)

    def _releasing(self, parent: ParentKey, blocks: tuple[Any, ...]) -> None:
        if self._reader is not None:
            self._reader.settle()  # no scatter of ours may still write these blocks
        if self.config.synthetic:
            # A late write to a freed block shows on the next verify. Only where
            # bytes are verified: filling a 1 GiB request costs ~0.5 s of host
            # memory bandwidth.
            self.buffer.fill_blocks([ref.block for ref in blocks], POISON)
        self._verified.pop(parent, None)

    def _bytes_ok(self, parent: ParentKey) -> bool:
        return not self.config.synthetic or self._verify(parent)

    def _forget(self, parent: ParentKey) -> None:
        self._release_when_ready.discard(parent)
        self._received_here.discard(parent)
        self._lend_of.pop(parent, None)
        for ticket in [t for t in self._reads if t.parent == parent]:
            del self._reads[ticket]  # a READ still in flight is polled on (`_read_flight`)
        if self._reader is not None:
            self._reader.forget(parent)

    def _tracking(self) -> int:
        return (
            len(self._release_when_ready) + len(self._verified) + len(self._received_here)
            + len(self._lend_of) + len(self._reads)
        )

    # -- verification (S2) --------------------------------------------------------------

    def _verify(self, parent: ParentKey) -> bool:
        lease = self.pool.lease_of(parent)
        expected = self._pattern(parent, self.config.rank, len(lease)).to(self.buffer.tensor.device)
        got = self.buffer.read_blocks(lease.block_list())
        if not torch.equal(got, expected):  # one comparison; which block, only on a mismatch
            for j, ref in enumerate(lease):
                if not torch.equal(got[j], expected[j]):
                    self.violations.append(f"S2: {parent} block {ref.block} holds foreign bytes")
                    break
            return False
        self._verified[parent] = len(lease) * self.block_bytes
        self.counters["bytes_verified"] += len(lease) * self.block_bytes
        return True

    # -- opening on admission --------------------------------------------------------------

    def _ctx_endpoints(self, pair: _Pair) -> list[Endpoint] | None:
        """GEN: the current endpoint of every rank of `pair`'s CTX instance, or
        None if one is unknown."""
        found = [self._peer_handles.get((pair.instance, r)) for r in range(pair.spec.tp)]
        if any(f is None for f in found):
            return None
        return [f[0] for f in found if f is not None]

    def _describe(self, lease: BlockRefs, pair: _Pair) -> list[BlockDescriptor] | bytes | BlockRuns:
        """An OPEN's block list for `lease`: for a lease of `RUNS_FROM_BLOCKS`
        or more, runs of consecutive blocks where `pair` negotiated them and
        they are few; else packed (arrays, no per-block object) where
        negotiated, else one descriptor per block."""
        addrs = self.buffer.block_addrs(lease.blocks)
        outcome = pair.negotiation
        big = len(lease) >= RUNS_FROM_BLOCKS
        if big and isinstance(outcome, Negotiated) and outcome.supports(Capability.BLOCK_RUNS):
            runs = pack_runs(lease.blocks, lease.generations, addrs, self.block_bytes)
            if runs is not None:
                self.counters["opens_runs"] += 1
                return runs
        if isinstance(outcome, Negotiated) and outcome.supports(Capability.PACKED_BLOCKS):
            self.counters["opens_packed"] += 1
            lengths = np.full(len(lease), self.block_bytes, dtype=np.uint32)
            return pack_blocks(lease.blocks, lengths, lease.generations, addrs)
        self.counters["opens_listed"] += 1
        return [
            BlockDescriptor(b, g, a, self.block_bytes)
            for b, g, a in zip(lease.block_list(), lease.generations.tolist(), addrs.tolist())
        ]

    def _open(self, parent: ParentKey, now: float) -> None:
        """GEN: install `parent`'s session and send OPEN on each of our edges
        (await-free: called while applying the admission). A CTX endpoint we
        do not know yet (a CTX rank restarted) is looked up first."""
        if not self.side.is_admitted(parent):
            return  # cancelled (and released) meanwhile: nothing to open
        if self.faults is not None and self.faults.opens:
            deferred = self.faults.opens.get(parent.request_id)
            if deferred is not None:
                deferred.append(parent)
                return
        pair = self._pairs.get(self._pair_of.get(parent, self._default_peer))
        if pair is None:  # its CTX instance left: the parent cannot proceed here
            self.counters["open_no_pair"] += 1
            self.member.record_failure(parent)
            self._nudge()
            return
        lend = self._lend_of.pop(parent, None)
        if lend is not None:
            self._read_lend(parent, lend, pair, now)
            return
        endpoints = self._ctx_endpoints(pair)
        if endpoints is None:
            self._own(self._open_later(parent, pair))
            return
        lease = self.pool.lease_of(parent)
        blocks = self._describe(lease, pair)
        buffer = BufferInfo(
            agent_name=self.transport.name,
            endpoint_epoch=self.our.epoch,
            memory=MemoryKind(self.buffer.mem_kind),
            device=self.buffer.device_id,
            blocks=blocks,
        )
        specs = []
        for edge in pair.shards.edges_for_gen_rank(self.config.rank):
            ticket = ContextTicket(
                request_id=parent.request_id,
                ctx_attempt=parent.ctx_attempt,
                gen_attempt=parent.gen_attempt,
                ctx=endpoints[edge[0]],
                gen=self.our,
                ctx_digest=pair.ctx_digest,
                gen_digest=pair.gen_digest,
            )
            expected = pair.shards.edge_bytes_per_block(edge) * len(lease)
            specs.append(
                GenEdgeSpec(ticket=ticket, buffer=buffer, num_tokens=self._tokens.get(parent, 0), expected_bytes=expected)
            )
        try:
            actions = self.side.install(parent, specs, now)
        except ProtocolError as exc:
            self.counters[f"refused_{type(exc).__name__}"] += 1
            return
        if self._reader is not None:  # scatter maps before the OPENs go out (off the data phase)
            self._reader.prepare(
                parent,
                staged_below(self.buffer.device, self.config.staged_below),
                staged_min_descriptors(self.buffer.device, self.config.staged_min_descriptors),
            )
        self._perform(actions)

    async def _open_later(self, parent: ParentKey, pair: _Pair) -> None:
        try:
            if pair.instance == self._default_peer:
                await self.connect()
            else:  # learn that instance's ranks (and their agents) on first use
                for (endpoint, name, metadata, geometry), handle in await self._directory().all_of.remote(pair.instance):
                    self._peer_handles[(endpoint.ns.instance_id, endpoint.ns.rank)] = (endpoint, handle)
                    self._learn_agent(name, metadata, geometry)
        except Exception as exc:
            log.warning("rank %s: cannot learn the CTX endpoints: %r", self.ns, exc)
        if self._ctx_endpoints(pair) is None:
            # No CTX rank to open to: the parent cannot proceed here.
            self.counters["open_no_endpoint"] += 1
            self.member.record_failure(parent)
            self._nudge()
            return
        self._open(parent, time.monotonic())
        self._ensure_polling()

    # -- the consumer -------------------------------------------------------------------

    async def free(self, parent: ParentKey) -> int:
        """GEN: the client is done with a decode-ready request's KV. Returns the
        bytes this rank verified for it (0 if it was not decode-ready here)."""
        try:
            actions = self.side.free(parent)
        except ProtocolError:
            return 0
        # Read before performing: the Release drops the bookkeeping. A late free
        # (the consumer deadline returned the KV already) finds none: 0 bytes.
        verified = self._verified.get(parent, 0)
        self._perform(actions)
        return verified

