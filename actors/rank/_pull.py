"""`_PullReader`: a GEN rank's side of pull (docs/design.md "Pull"): it READs
the blocks a CTX rank lent it, named by the ticket's sealed `Lend`, after
checking the lend against what it knows; `GenRankCore` is one."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.actors import _dataplane as dataplane
from kvhandoff.actors._names import agent_name
from kvhandoff.actors.rank._config import RankConfig, _Pair, log
from kvhandoff.actors.rank._core import RankCore
from kvhandoff.protocol import (
    BufferInfo,
    Cancel,
    CancelReason,
    Capability,
    ContextTicket,
    Endpoint,
    GenRank,
    Lend,
    LocalOutcome,
    MemoryKind,
    Negotiated,
    ParentKey,
    PeerBuffer,
    ProtocolError,
    PullEdgeSpec,
    RankNamespace,
    Role,
    pack_blocks,
)
from kvhandoff.topology import memory_pieces


class _PullReader(RankCore):
    """What a GEN rank does to READ a lend: install the edge as READs
    (`GenRank.install_pull`), post them, and refuse a lend it cannot read
    (answered at once where the lend is the lender's, else not believed).
    Its READs are polled to DONE or ERR with the CTX rank's WRITEs' loop
    (`_poll_posted`)."""

    side: GenRank

    def __init__(self, config: RankConfig, epoch: int, *, tensors: Sequence[torch.Tensor] | None = None) -> None:
        # Pull: the lend a receive brought, until its READs are installed
        # (`_open`); per edge ticket read, its READ chunk plans, the CTX
        # agent, the pieces (ours first) and that agent's registered buffer;
        # READs posted and not yet polled to DONE or ERR; the buffers of
        # the CTX agents we know (the directory's, by agent name).
        self._lend_of: dict[ParentKey, Lend] = {}
        self._reads: dict[ContextTicket, tuple[list[dataplane.ChunkPlan], str, tuple[dataplane.Piece, ...], dataplane.BufferGeometry]] = {}
        self._read_flight: dict[tuple[ContextTicket, int], dataplane.Chunk] = {}
        self._geometry: dict[str, dataplane.BufferGeometry] = {}
        self._read_pieces: dict[str, tuple[dataplane.Piece, ...]] = {}  # per CTX instance (one-rank pairs: one edge)
        super().__init__(config, epoch, tensors=tensors)

    # -- pull: READs of the blocks a CTX rank lent us ------------------------------------

    def _learn_agent(self, name: str, metadata: Any, geometry: dataplane.BufferGeometry) -> None:
        super()._learn_agent(name, metadata, geometry)
        self._geometry[name] = geometry
        if self.config.pull and name not in self.transport.peers:
            self.transport.add_peer(metadata)  # we READ from it

    def _read_lend(self, parent: ParentKey, lend: Lend, pair: _Pair, now: float, looked_up: bool = False) -> None:
        """Install `parent`'s edge as READs of the blocks `lend` names and
        post them (`GenRank.install_pull`), or refuse the lend
        (`_refuse_lend`). A CTX agent we do not know yet (it restarted) is
        looked up first, once."""
        ns = RankNamespace(instance_id=pair.spec.instance_id, role=Role.CTX, rank=0)
        ctx = Endpoint(ns=ns, epoch=lend.ctx_epoch)
        name = agent_name(self.config.deployment, ns, lend.ctx_epoch)
        geometry = self._geometry.get(name)
        known = self._peer_handles.get((ns.instance_id, 0))
        if known is not None and known[0].epoch > lend.ctx_epoch:
            # Lent by an incarnation that is gone: its blocks went with it.
            self._lend_failed(parent, "lend_of_a_past_lender", f"{ctx} was replaced by {known[0]}")
            return
        if geometry is None or name not in self.transport.peers:
            if not looked_up:
                self._own(self._read_lend_later(parent, lend, pair, ctx))
                return
            self._lend_failed(parent, "lend_of_an_unknown_lender", f"CTX agent {name} is not known")
            return
        if not lend.verify(geometry.lend_key, parent):
            # Not the lender's: garbled or forged on the way. Nothing of the
            # lend is believed, answered or remembered.
            self._lend_failed(parent, "lend_unsealed", f"the lend is not sealed by {name}")
            return
        outcome = pair.negotiation
        if pair.spec.tp != 1 or not isinstance(outcome, Negotiated) or not outcome.supports(Capability.PULL):
            self._refuse_lend(parent, lend, pair, "the pair did not agree on pull", now)
            return
        ticket = ContextTicket(
            request_id=parent.request_id,
            ctx_attempt=parent.ctx_attempt,
            gen_attempt=parent.gen_attempt,
            ctx=ctx,
            gen=Endpoint(ns=self.ns, epoch=lend.gen_epoch),
            ctx_digest=pair.ctx_digest,
            gen_digest=pair.gen_digest,
        )
        lease = self.pool.lease_of(parent)
        edge = (0, self.config.rank)
        try:
            source = np.asarray(lend.block_ids(), dtype=np.int64)
            # The pieces of a CTX -> GEN edge, seen from us: (our region,
            # offset, their region, offset, length), for a READ's (local, remote).
            pieces = self._read_pieces.get(pair.instance)
            if pieces is None:
                segments = memory_pieces(pair.shards, edge, pair.peer_kind, self.config.memory_kind)
                pieces = tuple((dr, do, sr, so, n) for sr, so, dr, do, n in dataplane.edge_pieces(segments, self.config.chunk_bytes))
                self._read_pieces[pair.instance] = pieces
            n = min(len(source), len(lease))  # unequal: `install_pull` refuses it right after
            pairs = np.stack([lease.blocks[:n].astype(np.int64), source[:n]], axis=1)
            plans = dataplane.plan_chunks(pieces, pairs, self.config.chunk_bytes)
            addrs = geometry.base + np.where(source < geometry.num_blocks, source, 0) * geometry.region_table()[0][1]
            block = pair.shards.ctx_block_bytes
            spec = PullEdgeSpec(
                ticket=ticket,
                source=BufferInfo(
                    agent_name=name,
                    endpoint_epoch=lend.ctx_epoch,
                    memory=MemoryKind(geometry.mem_kind),
                    device=geometry.device_id,
                    blocks=pack_blocks(
                        source, np.full(len(source), block, np.uint32), np.zeros(len(source), np.int64), addrs
                    ),
                ),
                num_tokens=self._tokens.get(parent, 0),
                lend_seq=lend.seq,
                num_chunks=max(len(plans), 1),
                expected_bytes=pair.shards.edge_bytes_per_block(edge) * len(lease),
                block_bytes=block,
                peer=PeerBuffer(
                    name, geometry.base, geometry.block_bytes, geometry.num_blocks,
                    block_stride=geometry.region_table()[0][1],
                ),
            )
            actions = self.side.install_pull(parent, [spec], now)
        except (ProtocolError, dataplane.DataPlaneError, ValueError) as exc:
            self._refuse_lend(parent, lend, pair, f"{type(exc).__name__}: {exc}", now)
            return
        self.counters["pulled"] += 1
        self._reads[ticket] = (plans, name, pieces, geometry)
        self._perform(actions)

    async def _read_lend_later(self, parent: ParentKey, lend: Lend, pair: _Pair, ctx: Endpoint) -> None:
        try:
            await self._peer(ctx)  # waits (bounded) for that incarnation's registration
        except Exception as exc:
            log.warning("rank %s: cannot learn the CTX agent of %s: %r", self.ns, ctx, exc)
        if not self.side.is_admitted(parent):
            return  # ended meanwhile (a cancel): its lend is answered by its FENCE
        self._read_lend(parent, lend, pair, time.monotonic(), looked_up=True)
        self._ensure_polling()

    def _refuse_lend(self, parent: ParentKey, lend: Lend, pair: _Pair, why: str, now: float) -> None:
        """Never read `lend`: answer the lender at once as a FENCE would be
        (NOT_STARTED; the lend is refused here for good), so its blocks come
        back now, not at its lease's end; the receive is "rejected". A lend made to
        another incarnation of this rank is not ours to answer (the lender
        learns that incarnation's death)."""
        ticket = ContextTicket(
            request_id=parent.request_id,
            ctx_attempt=parent.ctx_attempt,
            gen_attempt=parent.gen_attempt,
            ctx=Endpoint(ns=RankNamespace(instance_id=pair.spec.instance_id, role=Role.CTX, rank=0), epoch=lend.ctx_epoch),
            gen=Endpoint(ns=self.ns, epoch=lend.gen_epoch),
            ctx_digest=pair.ctx_digest,
            gen_digest=pair.gen_digest,
        )
        try:
            self._perform(self.side.fence(Cancel(ticket=ticket, reason=CancelReason.FAILURE, lend_seq=lend.seq), now))
        except ProtocolError as exc:
            self.counters[f"lend_unanswered_{type(exc).__name__}"] += 1
        self._lend_failed(parent, "lend_refused", f"lend {lend.seq}: {why}")

    def _lend_failed(self, parent: ParentKey, counter: str, why: str) -> None:
        """The receive of `parent` reads nothing: "rejected", as a REJECT
        refuses an OPEN's claim; the cancel it starts settles it here."""
        self.counters[counter] += 1
        log.warning("rank %s: %s reads nothing: %s", self.ns, parent.request_id, why)
        self._outcome.setdefault(parent, LocalOutcome.REJECTED, time.monotonic())
        self.member.record_failure(parent)
        self._nudge()

    def _spin_reads(self, parent: ParentKey) -> bool:
        """Poll our READs of `parent` here and now, without yielding, until
        none is in flight or `RankConfig.read_spin_s` passed; whether none is."""
        until = time.monotonic() + self.config.read_spin_s
        while True:
            if not any(ticket.parent == parent for ticket, _ in self._read_flight):
                return True
            now = time.monotonic()
            if now > until:
                return False
            self._poll_posted(self._read_flight, now)

    def _post_read(self, ticket: ContextTicket, index: int, now: float) -> None:
        """Post READ chunk `index` of `ticket`'s edge (as the CTX rank posts a
        WRITE: from prepared descriptor lists where it can)."""
        try:
            plans, peer, pieces, geometry = self._reads[ticket]
            plan = plans[index]
            prepared = None
            if self.config.prepared_descriptors:
                try:
                    prepared = self.transport.prepare(peer, pieces, geometry)
                except dataplane.DataPlaneError as exc:
                    self.counters["prepare_failed"] += 1
                    log.warning("rank %s: %s; posting built descriptors", self.ns, exc)
            if prepared is None:
                plan = dataplane.resolve_regions(plan, pieces, self.buffer.region_table(), geometry.region_table())
            self.counters["reads_prepared" if prepared is not None else "reads_built"] += 1
            chunk = self.transport.post(peer, plan, prepared=prepared, op="READ")
        except Exception as exc:  # nothing was posted: the chunk failed before DMA
            log.warning("rank %s: READ post failed: %r", self.ns, exc)
            self._perform(self.side.chunk_failed(ticket, index, now))
            return
        self._read_flight[(ticket, index)] = chunk
        self._posted_at = time.monotonic()  # the poll loop yields a moment (`HOT_AFTER_POST_S`)
        self._ensure_polling()

