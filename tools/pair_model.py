"""A pair model (h11's ConnectionPair): a CTX instance of M CtxRanks and a GEN
instance of N GenRanks wired together by the shard map's edges.

The protocol tests (tests/protocol) and the interleaving explorer
(`kvhandoff explore`, tools/explore.py) drive the real protocol objects
through it.

It plays the actors layer: performs the actions the protocol objects return,
pipes messages between them as encoded frames (`encode_frame`/`decode_frame`),
keeps a model of the DMA chunks in flight (which GEN and CTX block
incarnations each may still touch, for S1), and runs the agreement rounds of
each instance with the real `RoundLeader` and one `RoundFollower` per rank.
Ranks apply decisions through the protocol's `decision_steps`/`apply_step`,
as the rank actor does; news (cancel intents, failures, completions) reaches
the leader as the actor's does, in rank reports. A one-rank CTX instance
decides a prepared parent alone (`decide`), as its rank actor does; with
several CTX ranks each reports the parent prepared and the CTX round decides
it once every rank has (the leader's intersection). Tests can hold messages in the queues to reorder, duplicate or drop
them, restart a rank with a new epoch, and move time.

When the protocol misbehaves, the harness reports the broken contract as an
`AssertionError` that names it (S1, S3, S4, no-leak, L1), never as a
`KeyError`/`TypeError` of its own bookkeeping: every call into a rank goes
through `protocol_call` (a rank may raise only `ProtocolError`, the refusal
contract of S3), and every lookup the harness makes in its own tables is
guarded by an assertion that says which invariant a miss means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from functools import partial

import msgspec

from kvhandoff.protocol import (
    Action,
    AdmissionRequest,
    AdmissionStop,
    BlockDescriptor,
    BlockPool,
    BlockRef,
    BufferInfo,
    Cancel,
    CancelIntent,
    ContextTicket,
    CtxRank,
    DecodeReady,
    EdgeState,
    Endpoint,
    GenEdgeSpec,
    GenRank,
    MemoryKind,
    Open,
    ParentKey,
    ParentSettled,
    ParentState,
    PoolError,
    PostChunk,
    Prepared,
    ProtocolError,
    PullEdgeSpec,
    Quarantine,
    RankNamespace,
    Ready,
    Receipt,
    Reject,
    Release,
    Role,
    RoundDecision,
    RoundFollower,
    RoundLeader,
    SendMessage,
    SessionMessage,
    Step,
    Terminal,
    apply_step,
    block_columns,
    decision_steps,
    decode_frame,
    encode_frame,
    pairing_undo,
    pairing_veto,
    report_of,
)
from kvhandoff.topology import KVLayout, shard_map

__all__ = [
    "CHUNK_BYTES",
    "CTX_DIGEST",
    "GEN_DIGEST",
    "TIMEOUT",
    "Envelope",
    "Pair",
    "ProtocolCrash",
    "Write",
    "buffer_for",
    "ctx_buffer_for",
    "ctx_endpoint",
    "gen_endpoint",
    "make_ticket",
    "parent_key",
    "protocol_call",
]

CTX_DIGEST = bytes(range(32))
GEN_DIGEST = bytes(range(32, 64))
CHUNK_BYTES = 4096
TIMEOUT = 10.0
#: A model round never waits: every vote is in before it closes.
ROUND_TIMEOUT = 1.0


class ProtocolCrash(AssertionError):
    """A rank raised something other than a ProtocolError (or returned no action list)."""


def protocol_call(invariant: str, what: str, call: Callable[[], list[Action]]) -> list[Action]:
    """Run one call into a rank. A `ProtocolError` passes through (a typed refusal,
    which the caller checks changed nothing); anything else is the protocol
    breaking its contract and is reported as an assertion naming `invariant`."""
    try:
        actions = call()
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolCrash(
            f"{invariant}: {what} raised {type(exc).__name__}: {exc!r}; a rank must refuse"
            " with a ProtocolError and change nothing, or act"
        ) from exc
    if not isinstance(actions, list):
        raise ProtocolCrash(f"{invariant}: {what} returned {actions!r}, not a list of actions")
    return actions


def ctx_endpoint(epoch: int = 1, rank: int = 0, instance: int = 0) -> Endpoint:
    return Endpoint(ns=RankNamespace(instance_id=f"ctx{instance}", role=Role.CTX, rank=rank), epoch=epoch)


def gen_endpoint(epoch: int = 1, rank: int = 0) -> Endpoint:
    return Endpoint(ns=RankNamespace(instance_id="gen0", role=Role.GEN, rank=rank), epoch=epoch)


def parent_key(n: int, ctx_attempt: int = 0, gen_attempt: int = 0) -> ParentKey:
    return ParentKey(request_id=f"req-{n}", ctx_attempt=ctx_attempt, gen_attempt=gen_attempt)


def make_ticket(parent: ParentKey, ctx: Endpoint, gen: Endpoint) -> ContextTicket:
    return ContextTicket(
        request_id=parent.request_id,
        ctx_attempt=parent.ctx_attempt,
        gen_attempt=parent.gen_attempt,
        ctx=ctx,
        gen=gen,
        ctx_digest=CTX_DIGEST,
        gen_digest=GEN_DIGEST,
    )


def buffer_for(refs: Iterable[BlockRef], epoch: int) -> BufferInfo:
    """What a GEN actor builds from its lease: one descriptor per block."""
    return BufferInfo(
        agent_name=f"gen-agent-{epoch}",
        endpoint_epoch=epoch,
        memory=MemoryKind.DRAM,
        blocks=[
            BlockDescriptor(r.block, r.generation, r.block * CHUNK_BYTES, CHUNK_BYTES) for r in refs
        ],
    )


def ctx_buffer_for(refs: Iterable[BlockRef], epoch: int) -> BufferInfo:
    """Pull: the CTX blocks a ticket names to its reader, as an OPEN names GEN blocks."""
    return BufferInfo(
        agent_name=f"ctx-agent-{epoch}",
        endpoint_epoch=epoch,
        memory=MemoryKind.DRAM,
        blocks=[BlockDescriptor(r.block, r.generation, r.block * CHUNK_BYTES, CHUNK_BYTES) for r in refs],
    )


def model_edges(n_ctx: int, n_gen: int) -> tuple[tuple[int, int], ...]:
    """The (CTX rank, GEN rank) edges of a TP `n_ctx` -> `n_gen` handoff: the
    runtime's shard map (`topology.shard_map`) over a layout whose KV heads
    both TPs divide."""
    heads = n_ctx * n_gen
    layout = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=1, dtype="float16", tokens_per_block=1)
    return shard_map(layout, n_ctx, n_gen).edges


@dataclasses.dataclass(frozen=True)
class Write:
    """One posted chunk: which block incarnations it may still touch."""

    ticket: ContextTicket
    index: int
    ctx_rank: int
    ctx_epoch: int
    gen_epoch: int
    gen_rank: int
    ctx_refs: tuple[BlockRef, ...]
    gen_refs: tuple[BlockRef, ...]
    #: A READ the GEN rank posted (pull), not a CTX WRITE: the GEN polls it.
    pull: bool = False


@dataclasses.dataclass
class Envelope:
    to_role: Role
    to_rank: int
    frame: bytes


class Pair:
    """`n_ctx` CTX ranks and `n_gen` GEN ranks; every parent has one edge per
    edge of the shard map (TP 1 -> N: the CTX rank to each GEN rank; M -> 1:
    each CTX rank to the GEN rank; N -> N: rank to rank)."""

    def __init__(
        self,
        *,
        ctx_blocks: int = 16,
        gen_blocks: int = 16,
        n_gen: int = 1,
        n_ctx: int = 1,
        ctx_instances: int = 1,
        chunk_window: int = 2,
        timeout: float = TIMEOUT,
        conservative: bool = False,
        not_started_verdict: bool = True,
        direct: bool = False,
        pull: bool = False,
    ) -> None:
        if direct and n_ctx != 1:
            raise ValueError("the direct path admits at the OPEN on a one-rank CTX instance only")
        if direct and pull:
            raise ValueError("a pull handoff is lent at the CTX rank: no OPEN admits it")
        self.now = 0.0
        #: Pull: the CTX ranks lend their prefilled blocks (`lend`) and the GEN
        #: ranks READ them (`install` is `GenRank.install_pull`).
        self.pull = pull
        #: Pull: each lent ticket's lend number and the CTX blocks it names (as
        #: the ticket carries them to the reader), and each CTX incarnation's
        #: last lend number.
        self.lent: dict[ContextTicket, tuple[int, BufferInfo]] = {}
        self.lend_seqs: dict[tuple[int, int], int] = {}
        #: The direct path: no CTX round admits; the CTX rank admits a parent
        #: at its OPEN (`CtxRank.admit_at_open`) and reports it to its leader.
        self.direct = direct
        #: (blocks, lease) each parent asks for, for a CTX rank admitting at its OPEN.
        self.asked: dict[ParentKey, tuple[int, float]] = {}
        #: Whether the rounds apply the topology-wide NOT_STARTED verdict
        #: (`release_not_started`). The runtime does not (each rank releases
        #: on its own evidence once the cancel is decided); the explorer
        #: models the runtime.
        self.not_started_verdict = not_started_verdict
        self.timeout = timeout
        self.chunk_window = chunk_window
        self.conservative = conservative
        self.ctx_blocks = ctx_blocks
        self.gen_blocks = gen_blocks
        self.n_gen = n_gen
        self.n_ctx = n_ctx
        self.ctx_instances = ctx_instances
        self.edges = model_edges(n_ctx, n_gen)
        # The CTX ranks of every CTX instance, flat: rank r of instance i is
        # `ctxs[i * n_ctx + r]` (its "flat rank"; one instance: the rank).
        self.ctxs = [self._new_ctx(1, c, i) for i in range(ctx_instances) for c in range(n_ctx)]
        self.gens = [self._new_gen(1, r) for r in range(n_gen)]
        # One round leader per instance and one follower per rank, as the
        # coordinators and the rank actors hold them. An instance's key is
        # its role for the first CTX instance and the GEN instance, and
        # "ctx<i>" for another CTX instance (a fleet's).
        self.leaders: dict[Role | str, RoundLeader] = {
            self.ctx_key(i): RoundLeader(n_ctx, epochs=dict.fromkeys(range(n_ctx), 1)) for i in range(ctx_instances)
        }
        self.leaders[Role.GEN] = RoundLeader(n_gen, epochs=dict.fromkeys(range(n_gen), 1))
        self.ctx_followers = [RoundFollower(c, 1) for _ in range(ctx_instances) for c in range(n_ctx)]
        self.gen_followers = [RoundFollower(r, 1) for r in range(n_gen)]
        # What a coordinator adds to its next proposal: failures of a
        # restarted rank's in-flight parents, cancels undoing an admission
        # the peer instance refused.
        self.failures_pending: dict[Role | str, set[ParentKey]] = {k: set() for k in self.leaders}
        self.cancels_pending: dict[Role | str, set[ParentKey]] = {k: set() for k in self.leaders}
        #: The CTX instance each parent was admitted into (the caller's router).
        self.home: dict[ParentKey, int] = {}
        self.queue: list[Envelope] = []
        self.in_flight: dict[tuple[ContextTicket, int], Write] = {}
        self.strays: list[Write] = []  # writes of ERR chunks that may still land
        self.dead_gens: set[tuple[int, int]] = set()  # (rank, epoch) confirmed dead
        self.dead_ctxs: set[tuple[int, int]] = set()  # (rank, epoch) confirmed dead
        self.chunks: dict[ParentKey, int] = {}  # chunks per edge
        self.actions: list[Action] = []
        self.errors: list[ProtocolError] = []
        self.admission_stopped = False
        self.decode_ready: set[ParentKey] = set()
        # (CTX rank, its epoch, parent) for every Prepared a CTX rank
        # reported: the round's `prepared` channel. A parent is decided only
        # once it is here (a one-rank CTX instance: `decide`).
        self.prepared: set[tuple[int, int, ParentKey]] = set()

    # ---- construction --------------------------------------------------

    @property
    def ctx(self) -> CtxRank:
        """CTX rank 0 (the only one of a one-rank CTX instance)."""
        return self.ctxs[0]

    @ctx.setter
    def ctx(self, rank: CtxRank) -> None:
        self.ctxs[0] = rank

    @property
    def ctx_follower(self) -> RoundFollower:
        return self.ctx_followers[0]

    def gens_of(self, ctx_rank: int) -> list[int]:
        """The GEN ranks CTX rank `ctx_rank` (its rank in its instance) writes."""
        return [g for c, g in self.edges if c == ctx_rank]

    def ctxs_of(self, gen_rank: int, instance: int = 0) -> list[int]:
        """The flat ranks of CTX instance `instance` that write GEN rank `gen_rank`."""
        return [instance * self.n_ctx + c for c, g in self.edges if g == gen_rank]

    @staticmethod
    def ctx_key(instance: int) -> Role | str:
        """The rounds key of CTX instance `instance`."""
        return Role.CTX if instance == 0 else f"ctx{instance}"

    def flat(self, endpoint: Endpoint) -> int:
        """The flat rank of a CTX endpoint."""
        return int(endpoint.ns.instance_id[3:]) * self.n_ctx + endpoint.ns.rank

    def instance_of(self, flat: int) -> int:
        return flat // self.n_ctx

    def home_ranks(self, parent: ParentKey) -> list[int]:
        """The flat ranks of `parent`'s CTX instance."""
        base = self.home.get(parent, 0) * self.n_ctx
        return list(range(base, base + self.n_ctx))

    def _new_ctx(self, epoch: int, rank: int = 0, instance: int = 0) -> CtxRank:
        return CtxRank(
            ctx_endpoint(epoch, rank, instance),
            CTX_DIGEST,
            BlockPool(self.ctx_blocks),
            edges_per_parent=len(self.gens_of(rank)),
            transfer_timeout=self.timeout,
            chunk_window=self.chunk_window,
            conservative=self.conservative,
        )

    def _new_gen(self, epoch: int, rank: int) -> GenRank:
        gen = GenRank(
            gen_endpoint(epoch, rank),
            GEN_DIGEST,
            BlockPool(self.gen_blocks),
            transfer_timeout=self.timeout,
        )
        gen.chunk_window = self.chunk_window  # its READs, in pull
        return gen

    def ranks(self) -> list[CtxRank | GenRank]:
        return [*self.ctxs, *self.gens]

    def tickets(self, parent: ParentKey) -> list[ContextTicket]:
        """One ticket per edge, in the shard map's order."""
        base = self.home.get(parent, 0) * self.n_ctx
        return [make_ticket(parent, self.ctxs[base + c].our, self.gens[g].our) for c, g in self.edges]

    def gen_specs(self, parent: ParentKey, gen_rank: int) -> list[GenEdgeSpec]:
        """What GEN rank `gen_rank` installs for `parent`: one edge per CTX
        rank that writes it, each over the rank's whole lease."""
        gen = self.gens[gen_rank]
        buffer = buffer_for(gen.lease(parent), gen.our.epoch)
        return [
            GenEdgeSpec(
                ticket=make_ticket(parent, self.ctxs[c].our, gen.our),
                buffer=buffer,
                num_tokens=16,
                expected_bytes=self.chunks[parent] * CHUNK_BYTES,
            )
            for c in self.ctxs_of(gen_rank, self.home.get(parent, 0))
        ]

    # ---- lifecycle steps (what the actors and rounds would call) -------

    def admit(
        self, parent: ParentKey, *, blocks: int = 2, chunks: int = 2, lease: float = 5.0, ctx_instance: int = 0
    ) -> None:
        """One admission round in each instance (each rank leases in its
        vote); GEN's is vetoed when the CTX instance did not admit, and the
        CTX's admission undone (a cancel) when GEN's round did not."""
        self.chunks[parent] = chunks
        self.home[parent] = ctx_instance
        key = self.ctx_key(ctx_instance)
        request = AdmissionRequest(parent=parent, num_tokens=16)
        if self.direct:
            # The GEN instance admits alone; its OPEN is the CTX's admission.
            self.asked[parent] = (blocks, lease)
            self._round(Role.GEN, [request], blocks=blocks, lease=lease)
            return
        # The GEN instance submits and asks the CTX instance (its peer) to
        # admit while its own ranks vote (the coordinators' pairing).
        ctx = self._round(key, [request], blocks=blocks, lease=lease)
        vetoed = pairing_veto([parent], ctx.admitted)
        gen = self._round(Role.GEN, [request], blocks=blocks, lease=lease, vetoed=vetoed)
        self.cancels_pending[key].update(pairing_undo(ctx.admitted, gen.admitted))
        # Pairing: a handoff admitted by one instance alone is taken back.
        assert parent not in gen.admitted or parent in ctx.admitted, (
            f"pairing: the GEN instance admitted {parent!r}, which its CTX instance refused"
        )
        assert parent not in ctx.admitted or parent in gen.admitted or parent in self.cancels_pending[key], (
            f"pairing: the CTX instance keeps {parent!r}, which its GEN instance refused"
        )

    def pull_specs(self, parent: ParentKey, gen_rank: int) -> list[PullEdgeSpec]:
        """What GEN rank `gen_rank` installs for `parent` in pull: one READ
        edge per CTX rank of its edges, over the blocks that rank lent."""
        gen = self.gens[gen_rank]
        specs = []
        for c in self.ctxs_of(gen_rank, self.home.get(parent, 0)):
            ticket = make_ticket(parent, self.ctxs[c].our, gen.our)
            assert ticket in self.lent, f"harness: {ticket.edge} of {parent!r} was never lent"
            seq, source = self.lent[ticket]
            specs.append(
                PullEdgeSpec(
                    ticket=ticket,
                    source=source,
                    num_tokens=16,
                    lend_seq=seq,
                    num_chunks=self.chunks[parent],
                    expected_bytes=self.chunks[parent] * CHUNK_BYTES,
                    block_bytes=CHUNK_BYTES,
                )
            )
        return specs

    def lent_to(self, parent: ParentKey, gen_rank: int) -> bool:
        """Pull: whether every CTX rank GEN rank `gen_rank` reads from lent
        `parent` (the ticket reaches the reader only after the publish)."""
        gen = self.gens[gen_rank]
        return all(
            make_ticket(parent, self.ctxs[c].our, gen.our) in self.lent
            for c in self.ctxs_of(gen_rank, self.home.get(parent, 0))
        )

    def lend(self, parent: ParentKey, ctx_rank: int | None = None) -> None:
        """Pull: CTX rank `ctx_rank` (flat; every rank of the parent's CTX
        instance: None) lends its prefilled blocks to the GEN ranks of its edges."""
        for c in self.home_ranks(parent) if ctx_rank is None else (ctx_rank,):
            ctx = self.ctxs[c]
            key = (c, ctx.our.epoch)
            seq = self.lend_seqs[key] = self.lend_seqs.get(key, 0) + 1
            readers = {
                make_ticket(parent, ctx.our, self.gens[g].our): self.chunks[parent] * CHUNK_BYTES
                for g in self.gens_of(ctx.our.ns.rank)
            }
            self._act(
                "S3",
                f"lend({parent!r}) on {ctx.our.ns}",
                partial(ctx.lend, parent, readers, lend_seq=seq, now=self.now),
                ctx,
            )
            source = ctx_buffer_for(ctx.lease(parent), ctx.our.epoch)
            for ticket in readers:
                self.lent[ticket] = (seq, source)

    def prefill(self, parent: ParentKey, ctx_rank: int | None = None) -> None:
        """CTX rank `ctx_rank` (a flat rank; every rank of the parent's CTX
        instance: None) finished its prefill."""
        for c in self.home_ranks(parent) if ctx_rank is None else (ctx_rank,):
            ctx = self.ctxs[c]
            self._act("S3", f"prefilled({parent!r}) on {ctx.our.ns}", partial(ctx.prefilled, parent), ctx)

    def install(self, parent: ParentKey, gen_rank: int | None = None) -> None:
        """GEN rank `gen_rank` (every GEN rank: None) installs its edges of
        `parent` (one OPEN per edge)."""
        for g in range(self.n_gen) if gen_rank is None else (gen_rank,):
            gen = self.gens[g]
            install = (
                partial(gen.install_pull, parent, self.pull_specs(parent, g), self.now)
                if self.pull
                else partial(gen.install, parent, self.gen_specs(parent, g), self.now)
            )
            self._act("S3", f"install({parent!r}) on {gen.our.ns}", install, gen)

    def decide(self, parent: ParentKey) -> None:
        """A one-rank CTX instance decides a prepared parent alone (its rank
        actor does, `decided_alone`); with several ranks the CTX round
        decides it (`run_rounds`)."""
        assert self.n_ctx == 1, "harness: a CTX instance of several ranks decides in its round"
        ctx = self.ctxs[self.home.get(parent, 0)]
        self._act("S3", f"decided({parent!r})", lambda: ctx.decided(parent, self.now), ctx)

    def all_prepared(self, parent: ParentKey) -> bool:
        """A one-rank CTX instance reported the parent `Prepared` and it is
        still RESIDENT (only prepared parents nobody cancelled are decided)."""
        if self.n_ctx != 1:
            return False
        k = self.home.get(parent, 0)
        ctx = self.ctxs[k]
        return (k, ctx.our.epoch, parent) in self.prepared and ctx.parent_state(parent) is ParentState.RESIDENT

    def run_rounds(self) -> None:
        """A round in each instance that has something to decide (news its
        ranks reported, failures or cancels its coordinator adds), then, if
        modelled, the topology-wide NOT_STARTED verdict."""
        for key in list(self.leaders):
            if self.round_due(key):
                self._round(key)
        if not self.not_started_verdict:
            return
        for parent in self._not_started():
            for member in self.ranks():
                if parent in member.parents():
                    self._act(
                        "S1",
                        f"NOT_STARTED verdict for {parent!r}",
                        partial(member.release_not_started, parent),
                        member,
                    )

    def _not_started(self) -> list[ParentKey]:
        """The parents the topology-wide NOT_STARTED verdict releases: every
        CTX rank (the writers) holds the parent and proved NOT_STARTED, and
        no GEN rank that holds it has contrary evidence."""
        out = []
        for parent in sorted({p for g in self.gens for p in g.parents()}, key=repr):
            if all(
                parent in self.ctxs[k].parents() and self.ctxs[k].local_not_started(parent)
                for k in self.home_ranks(parent)
            ) and all(g.local_not_started(parent) for g in self.gens if parent in g.parents()):
                out.append(parent)
        return out

    def verdict_due(self) -> bool:
        """Whether the NOT_STARTED verdict (when modelled) would release a parent."""
        return self.not_started_verdict and bool(self._not_started())

    def round_due(self, role: Role | str) -> bool:
        """Would a round of `role`'s instance decide anything now (the
        coordinator's test before it runs a round without admissions)?"""
        leader = self.leaders[role]
        self._push_reports(role)
        return bool(
            (self.failures_pending[role] | self.cancels_pending[role]) & leader.in_flight
            or leader.reports_decide()
        )

    def rounds_due(self) -> bool:
        return any(self.round_due(key) for key in self.leaders) or self.verdict_due()

    def normalize_rounds(self) -> None:
        """Renumber the rounds so that equal states compare equal (the
        explorer's canonical form). Between two steps no round is open and
        every follower applied its leader's last decision, so the numbers
        carry no information: the next round becomes 1, report sequences 0,
        and every set is rebuilt in one order. Each report is pushed first,
        so the stored reports are the followers' news."""
        for role in self.leaders:
            self._push_reports(role)
            leader = self.leaders[role]
            assert leader.proposal is None, "harness: a round is open between steps"
            shift = leader.next_round - 1
            leader.next_round = 1
            leader.in_flight = set(sorted(leader.in_flight, key=repr))
            leader.decided = set(sorted(leader.decided, key=repr))
            leader._alone = set(sorted(leader._alone, key=repr))  # noqa: SLF001
            leader._alone_ended = set(sorted(leader._alone_ended, key=repr))  # noqa: SLF001
            leader._reports = {  # noqa: SLF001 (the model's canonical form)
                rank: msgspec.structs.replace(got, seq=0) for rank, got in sorted(leader._reports.items())  # noqa: SLF001
            }
            for _, follower in self._instance(role):
                assert follower.last_applied == shift, "harness: a follower missed a decision"
                follower.last_applied = follower.last_voted = 0
                follower._report_seq = 0  # noqa: SLF001
                follower._reported = (0, frozenset(), frozenset())  # noqa: SLF001
                for name in ("_cancels", "_completions", "_failures", "_prepared", "_admitted"):
                    setattr(follower, name, set(sorted(getattr(follower, name), key=repr)))
            self.failures_pending[role] = set(sorted(self.failures_pending[role], key=repr))
            self.cancels_pending[role] = set(sorted(self.cancels_pending[role], key=repr))

    def _instance(self, role: Role | str) -> list[tuple[CtxRank | GenRank, RoundFollower]]:
        """The ranks and followers of the instance with rounds key `role`."""
        if role is Role.GEN:
            return list(zip(self.gens, self.gen_followers, strict=True))
        base = (0 if role is Role.CTX else int(str(role)[3:])) * self.n_ctx
        span = slice(base, base + self.n_ctx)
        return list(zip(self.ctxs[span], self.ctx_followers[span], strict=True))

    def _follower(self, rank: CtxRank | GenRank) -> RoundFollower | None:
        """The follower of `rank`'s current incarnation; None for an old one."""
        for role in self.leaders:
            for current, follower in self._instance(role):
                if rank is current:
                    return follower
        return None

    def _push_reports(self, role: Role | str) -> None:
        """Every rank of `role`'s instance pushes its news (a `RankReport`)."""
        leader = self.leaders[role]
        for _, follower in self._instance(role):
            leader.report(follower.report())

    def _round(
        self,
        role: Role | str,
        admissions: Iterable[AdmissionRequest] = (),
        *,
        blocks: int = 0,
        lease: float = 0.0,
        vetoed: Iterable[ParentKey] = (),
    ) -> RoundDecision:
        """One round of `role`'s instance, run by its real leader: votes (a
        lease per admission) or, without admissions, the ranks' reports;
        then every rank applies the decision, in order, exactly once."""
        leader = self.leaders[role]
        admissions = tuple(admissions)
        pending = self.failures_pending[role] & leader.in_flight
        proposal = leader.open_round(
            admissions,
            self.cancels_pending[role],
            now=self.now,
            timeout=ROUND_TIMEOUT,
            failures=pending,
        )
        self.failures_pending[role].clear()
        self.cancels_pending[role].clear()
        if admissions:
            for rank, follower in self._instance(role):
                leased = []
                for request in admissions:
                    try:
                        if isinstance(rank, CtxRank):
                            rank.admit(request.parent, blocks, now=self.now, lease_deadline=self.now + lease)
                        else:
                            rank.admit(request.parent, blocks, now=self.now, deadline=self.now + lease)
                    except PoolError:
                        continue
                    leased.append(request.parent)
                leader.receive_vote(follower.vote_with_news(proposal, admit_ok=leased), self.now)
        else:
            self._push_reports(role)
            leader.votes_from_reports(self.now)
        decision = leader.close(self.now, vetoed=vetoed)
        for rank, follower in self._instance(role):
            follower.apply(decision)
            for step, parent in decision_steps(decision, rank.parents()):
                if step is Step.ADMITTED:
                    continue  # the role's work is its own step (`prefill`, `install`)
                self._act(
                    "L1",
                    f"{step.value} {parent!r} on {rank.our.ns}",
                    partial(apply_step, rank, step, parent, self.now),
                    rank,
                )
            follower.forget(rank.parents().__contains__)
        return decision

    def client_cancel(self, parent: ParentKey) -> None:
        """A client's cancel: its coordinator puts it in the next round's
        proposal and tells the peer instance's coordinator, which does the
        same (`Coordinator.cancel`)."""
        for role in (self.ctx_key(self.home.get(parent, 0)), Role.GEN):
            self.cancels_pending[role].add(parent)

    def free(self, parent: ParentKey) -> None:
        for gen in self.gens:
            if parent in gen.parents():
                self._act("L1", f"free of {parent!r}", partial(gen.free, parent), gen)

    def expire(self) -> None:
        for rank in self.ranks():
            self._act(
                "L1", f"expire({self.now}) on {rank.our.ns}", partial(rank.expire, self.now), rank
            )

    # ---- the data plane model ------------------------------------------

    def polled(self, write: Write) -> bool:
        """Whether the incarnation that posted `write` (the CTX rank's; in
        pull the GEN rank's) still polls it."""
        if write.pull:
            return write.gen_epoch == self.gens[write.gen_rank].our.epoch
        return write.ctx_epoch == self.ctxs[write.ctx_rank].our.epoch

    def _poster(self, write: Write) -> CtxRank | GenRank:
        return self.gens[write.gen_rank] if write.pull else self.ctxs[write.ctx_rank]

    def finish_chunk(self, key: tuple[ContextTicket, int], *, ok: bool = True) -> None:
        """A posted chunk reports DONE (ok) or ERR; only its own CTX incarnation hears it."""
        assert key in self.in_flight, f"harness: chunk {key[1]} of {key[0].edge} was never posted"
        write = self.in_flight.pop(key)
        if not self.polled(write):
            return  # the incarnation that posted it is gone: nobody polls it
        ticket, index = key
        ctx = self._poster(write)
        what = f"chunk_{'done' if ok else 'failed'}({ticket.request_id} {ticket.edge} #{index})"
        try:
            if ok:
                actions = protocol_call(
                    "S1", what, lambda: ctx.chunk_done(ticket, index, CHUNK_BYTES, self.now)
                )
            else:
                actions = protocol_call(
                    "S1", what, lambda: ctx.chunk_failed(ticket, index, self.now)
                )
        except ProtocolError as exc:
            # The poster posted this chunk itself: it must hear its completion, or the
            # chunk's blocks could be released while the DMA may still run.
            raise AssertionError(
                f"S1: the CTX refused {what} of a chunk it posted: {exc!r}"
            ) from exc
        self.perform(actions, ctx)

    def fail_chunk_partially(self, key: tuple[ContextTicket, int], descriptors: int = 2) -> None:
        """A posted chunk of several descriptors reports ERR while others of
        its writes still run: the write stays in flight (it may still land)."""
        assert key in self.in_flight, f"harness: chunk {key[1]} of {key[0].edge} was never posted"
        ticket, index = key
        ctx = self._poster(self.in_flight[key])
        what = f"chunk_failed({ticket.request_id} {ticket.edge} #{index}, descriptors={descriptors})"
        self.perform(
            protocol_call("S1", what, lambda: ctx.chunk_failed(ticket, index, self.now, descriptors)),
            ctx,
        )
        # The poster never hears of it again (ERR is terminal for NIXL), but
        # its writes may still land: a stray, checked by `check_s1` until the
        # incarnation that posted it is gone (`restart_ctx`; in pull
        # `restart_gen`, or its source's confirmed death: a dead process
        # serves no bytes).
        write = self.in_flight.pop(key)
        if not (write.pull and (write.ctx_rank, write.ctx_epoch) in self.dead_ctxs):
            self.strays.append(write)

    # ---- restarts ------------------------------------------------------

    def restart_gen(self, rank: int = 0, *, notify: bool = True) -> None:
        """GEN rank `rank` restarts with a new epoch: fresh pool, no sessions."""
        old = self.gens[rank]
        self.gens[rank] = self._new_gen(old.our.epoch + 1, rank)
        self.gen_followers[rank] = self._rejoin(Role.GEN, rank, old.our.epoch + 1)
        # Its process is gone: the strays of its READs land nowhere any more.
        self.strays = [w for w in self.strays if not (w.pull and (w.gen_rank, w.gen_epoch) == (rank, old.our.epoch))]
        if notify:
            for c in [k for i in range(self.ctx_instances) for k in self.ctxs_of(rank, i)]:
                ctx = self.ctxs[c]
                self._act(
                    "S1",
                    f"{ctx.our.ns} peer_restarted",
                    partial(ctx.peer_restarted, self.gens[rank].our, self.now),
                    ctx,
                )

    def _rejoin(self, role: Role | str, rank: int, epoch: int) -> RoundFollower:
        """What the coordinator does when it replaces a rank: the leader takes
        the new epoch (the old incarnation's votes and reports are refused),
        the new follower joins at the next round, and every parent in flight
        fails in the next round (the dead rank held a shard of each)."""
        leader = self.leaders[role]
        leader.set_epoch(rank, epoch)
        follower = RoundFollower(rank, epoch)
        follower.join(leader.next_round)
        self.failures_pending[role] |= leader.in_flight
        return follower

    def confirm_gen_dead(self, rank: int, epoch: int) -> None:
        """The directory confirmed GEN incarnation (`rank`, `epoch`) dead and
        tells every CTX rank that wrote it (`peer_dead`). A write toward it
        lands nowhere that matters any more: it only reads the CTX's blocks."""
        self.dead_gens.add((rank, epoch))
        # Its READs (pull) read nothing any more.
        self.in_flight = {
            k: w for k, w in self.in_flight.items() if not (w.pull and (w.gen_rank, w.gen_epoch) == (rank, epoch))
        }
        dead = Endpoint(ns=self.gens[rank].our.ns, epoch=epoch)
        for c in [k for i in range(self.ctx_instances) for k in self.ctxs_of(rank, i)]:
            ctx = self.ctxs[c]
            self._act("S1", f"{ctx.our.ns} peer_dead", partial(ctx.peer_dead, dead, self.now), ctx)

    def restart_ctx(self, rank: int = 0, *, notify: bool = True) -> None:
        """CTX rank `rank` (flat) restarts with a new epoch: fresh pool, no sessions."""
        old = self.ctxs[rank]
        instance, local = divmod(rank, self.n_ctx)
        self.ctxs[rank] = new = self._new_ctx(old.our.epoch + 1, local, instance)
        self.ctx_followers[rank] = self._rejoin(self.ctx_key(instance), local, old.our.epoch + 1)
        # Its process is gone: the strays of its WRITEs land nowhere any more
        # (the READs of its memory, in pull, end with its confirmed death).
        self.strays = [w for w in self.strays if w.pull or (w.ctx_rank, w.ctx_epoch) != (rank, old.our.epoch)]
        if notify:
            for g in self.gens_of(local):
                gen = self.gens[g]
                self._act(
                    "S1", f"{gen.our.ns} peer_restarted", partial(gen.peer_restarted, new.our, self.now), gen
                )

    def confirm_ctx_dead(self, rank: int, epoch: int) -> None:
        """The directory confirmed CTX incarnation (`rank`, `epoch`) dead and
        tells every GEN rank it wrote (`peer_dead`): its writes land nowhere now."""
        self.dead_ctxs.add((rank, epoch))
        # Its WRITEs land nowhere now; READs of its memory (pull) are the
        # GEN ranks' to poll to an end, and what is left of one that failed
        # part-way brings nothing more: a dead process serves no bytes.
        self.in_flight = {
            k: w for k, w in self.in_flight.items() if w.pull or (w.ctx_rank, w.ctx_epoch) != (rank, epoch)
        }
        self.strays = [w for w in self.strays if not (w.pull and (w.ctx_rank, w.ctx_epoch) == (rank, epoch))]
        dead = Endpoint(ns=self.ctxs[rank].our.ns, epoch=epoch)
        for g in self.gens_of(rank % self.n_ctx):
            gen = self.gens[g]
            self._act("S1", f"{gen.our.ns} peer_dead", partial(gen.peer_dead, dead, self.now), gen)

    # ---- actions and messages ------------------------------------------

    def _act(
        self,
        invariant: str,
        what: str,
        call: Callable[[], list[Action]],
        by: CtxRank | GenRank | None = None,
    ) -> None:
        """Perform what one of the harness's own calls into rank `by` returns."""
        self.perform(protocol_call(invariant, what, call), by)

    def perform(self, actions: Iterable[Action], by: CtxRank | GenRank | None = None) -> None:
        """Perform the actions rank `by` returned, as its actor would: news
        for the rounds (a cancel intent, a failure, a completion) goes to its
        follower (an old incarnation's is void, as its reports are refused)."""
        for action in actions:
            self.actions.append(action)
            # The rank's verdict on what the action tells its rounds is the
            # protocol's (`report_of`, as the actor's `_report`); the model's
            # bytes always verify (the writes it plays carry no payload).
            report = report_of(action, lambda _parent: True)
            if report is not None and report.news is not None:
                assert by is not None, f"harness: {action!r} performed without the rank that produced it"
                follower = self._follower(by)
                if follower is not None:
                    follower.record(report.news, report.parent)
            match action:
                case SendMessage(to=to, message=message):
                    rank = self.flat(to) if to.ns.role is Role.CTX else to.ns.rank
                    self.queue.append(Envelope(to.ns.role, rank, encode_frame(message)))
                case PostChunk(ticket=ticket, index=index) if self.pull:
                    self._post_read(ticket, index, by)
                case PostChunk(ticket=ticket, index=index):
                    # The poster: the rank that returned it (a test may perform it for the ticket's).
                    poster = by if isinstance(by, CtxRank) else self.ctxs[self.flat(ticket.ctx)]
                    assert poster.pool.holds(ticket.parent), (
                        f"S1: PostChunk {index} of {ticket.edge} for {ticket.parent!r},"
                        " whose lease the CTX no longer holds: the DMA would read freed blocks"
                    )
                    assert (ticket, index) not in self.in_flight, (
                        f"S1: chunk {index} of {ticket.edge} posted again while in flight"
                    )
                    gen_refs: tuple[BlockRef, ...] = ()
                    edge_open = self._open_for(poster, ticket)
                    if edge_open is not None:
                        cols = block_columns(edge_open.buffer)  # any form of the block list
                        gen_refs = tuple(map(BlockRef, cols.blocks.tolist(), cols.generations.tolist()))
                    self.in_flight[(ticket, index)] = self._write(
                        ticket, index, tuple(poster.pool.lease_of(ticket.parent)), gen_refs
                    )
                case AdmissionStop():
                    self.admission_stopped = True
                case DecodeReady(parent=parent):
                    self.decode_ready.add(parent)
                case Prepared(parent=parent):
                    assert isinstance(by, CtxRank), f"harness: {action!r} from {by!r}"
                    key = (self.flat(by.our), by.our.epoch, parent)
                    assert key not in self.prepared, f"Prepared({parent!r}) reported twice"
                    edges = by.edges(parent)
                    assert len(edges) == len(self.gens_of(by.our.ns.rank)) and all(
                        e.state is EdgeState.PREPARED for e in edges.values()
                    ), f"Prepared({parent!r}) with edges {[e.state for e in edges.values()]}"
                    self.prepared.add(key)
                    follower = self._follower(by)
                    if self.n_ctx > 1 and follower is not None:
                        # The rank votes it prepared; the CTX round decides.
                        follower.record_prepared(parent)
                case Release() | Quarantine() | ParentSettled() | CancelIntent():
                    pass
                case _:
                    pass

    def _post_read(self, ticket: ContextTicket, index: int, by: CtxRank | GenRank | None) -> None:
        """Pull: a GEN rank posted READ chunk `index`: it reads the CTX
        blocks its edge names and writes its own lease."""
        reader = by if isinstance(by, GenRank) else self.gens[ticket.gen.ns.rank]
        assert reader.pool.holds(ticket.parent), (
            f"S1: READ {index} of {ticket.edge} for {ticket.parent!r}, whose lease the GEN no"
            " longer holds: the DMA would write freed blocks"
        )
        assert (ticket, index) not in self.in_flight, f"S1: chunk {index} of {ticket.edge} posted again while in flight"
        cols = block_columns(reader.session_open(ticket).buffer)
        self.in_flight[(ticket, index)] = self._write(
            ticket,
            index,
            tuple(map(BlockRef, cols.blocks.tolist(), cols.generations.tolist())),
            tuple(reader.pool.lease_of(ticket.parent)),
            pull=True,
        )

    def _write(
        self,
        ticket: ContextTicket,
        index: int,
        ctx_refs: tuple[BlockRef, ...],
        gen_refs: tuple[BlockRef, ...],
        *,
        pull: bool = False,
    ) -> Write:
        """The in-flight DMA of chunk `index` of `ticket`'s edge: which blocks
        of which incarnations it reads and writes."""
        return Write(
            ticket=ticket,
            index=index,
            ctx_rank=self.flat(ticket.ctx),
            ctx_epoch=ticket.ctx.epoch,
            gen_epoch=ticket.gen.epoch,
            gen_rank=ticket.gen.ns.rank,
            ctx_refs=ctx_refs,
            gen_refs=gen_refs,
            pull=pull,
        )

    @staticmethod
    def _open_for(ctx: CtxRank, ticket: ContextTicket) -> Open | None:
        # The CTX recorded the OPEN; its descriptors say which GEN blocks a chunk writes.
        try:
            return ctx.session_open(ticket)
        except ProtocolError:
            return None

    def deliver(self, i: int = 0) -> ProtocolError | None:
        """Deliver queued message `i`; return the ProtocolError it raised, if any."""
        env = self.queue.pop(i)
        return self.deliver_frame(env.to_role, env.to_rank, env.frame)

    def deliver_frame(self, role: Role, rank: int, frame: bytes) -> ProtocolError | None:
        message = decode_frame(frame)
        assert isinstance(message, (Open, Ready, Cancel, Terminal, Receipt, Reject))
        return self.deliver_message(role, rank, message)

    def deliver_message(
        self, role: Role, rank: int, message: SessionMessage
    ) -> ProtocolError | None:
        what = f"{role.value} rank {rank} receive({type(message).__name__} {message.ticket.request_id})"
        try:
            receiver: CtxRank | GenRank
            if role is Role.CTX:
                num_chunks = self.chunks.get(message.ticket.parent, 1)
                assert 0 <= rank < len(self.ctxs), f"S3: {what}: no CTX rank {rank} exists"
                ctx = receiver = self.ctxs[rank]
                if self.direct and isinstance(message, Open) and message.ticket.parent not in ctx.parents():
                    # The rank is its whole instance: it admits at the OPEN
                    # (or refuses it, changing nothing) and tells its leader.
                    blocks, lease = self.asked.get(message.ticket.parent, (1, 5.0))
                    actions = protocol_call(
                        "S3",
                        what,
                        lambda: ctx.admit_at_open(
                            message, blocks, now=self.now, lease_deadline=self.now + lease, num_chunks=num_chunks
                        ),
                    )
                    follower = self._follower(ctx)
                    if follower is not None:
                        follower.record_admitted(message.ticket.parent)
                else:
                    actions = protocol_call(
                        "S3", what, lambda: ctx.receive(message, self.now, num_chunks=num_chunks)
                    )
            else:
                assert 0 <= rank < len(self.gens), f"S3: {what}: no GEN rank {rank} exists"
                gen = receiver = self.gens[rank]
                actions = protocol_call("S3", what, lambda: gen.receive(message, self.now))
        except ProtocolError as error:
            self.errors.append(error)
            if role is Role.CTX and isinstance(message, Open):
                # The actor answers a refused OPEN with a REJECT (to the ticket's GEN).
                reject: Reject | None = self.ctxs[rank].refuse(message, error)
                if reject is not None:  # an OPEN not addressed to us is dropped silently
                    self.queue.append(
                        Envelope(Role.GEN, message.ticket.gen.ns.rank, encode_frame(reject))
                    )
            return error
        self.perform(actions, receiver)
        return None

    def deliver_all(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.queue:
                return
            self.deliver(0)
        raise AssertionError("message storm: queue never drained")

    def pump(self, limit: int = 100) -> None:
        """Deliver messages and finish chunks until nothing moves."""
        for _ in range(limit):
            if self.queue:
                self.deliver_all()
            elif any(self.polled(w) for w in self.in_flight.values()):
                key = next(k for k, w in self.in_flight.items() if self.polled(w))
                self.finish_chunk(key)
            else:
                return
        raise AssertionError("pump did not settle")

    # ---- whole handoffs and invariants -----------------------------------

    def handoff(self, parent: ParentKey, *, blocks: int = 2, chunks: int = 2) -> None:
        """The success path, start to decode-ready."""
        self.admit(parent, blocks=blocks, chunks=chunks)
        self.prefill(parent)
        if self.pull:
            self.lend(parent)
            self.install(parent)
            self.pump()
            self.run_rounds()
            return
        self.install(parent)
        self.deliver_all()
        if self.n_ctx == 1:
            assert self.all_prepared(parent)
            self.decide(parent)
        else:
            self.run_rounds()  # every CTX rank reported it prepared: the round decides
        self.pump()
        self.run_rounds()

    def settle_everything(self, rounds: int = 12) -> None:
        """Drive every parent to an end: deliver, finish chunks, decide, expire, rounds."""
        for _ in range(rounds):
            self.pump()
            for parent in sorted({q for ctx in self.ctxs for q in ctx.parents()}, key=repr):
                if self.all_prepared(parent):
                    self.decide(parent)
            self.pump()
            self.run_rounds()
            for parent in sorted(self.decode_ready, key=repr):
                self.free(parent)
            self.now += self.timeout + 1
            self.expire()

    def check_s1(self) -> None:
        """No block a chunk may still touch is FREE or re-leased (same incarnation)."""
        for write in [*self.in_flight.values(), *self.strays]:
            # A WRITE toward a dead GEN incarnation lands nowhere that matters,
            # and a READ by one reads for nobody: the CTX blocks may be reused.
            target_dead = any(r == write.gen_rank and e >= write.gen_epoch for r, e in self.dead_gens)
            assert 0 <= write.ctx_rank < len(self.ctxs), f"S1: {write} comes from no CTX rank"
            ctx = self.ctxs[write.ctx_rank]
            if write.ctx_epoch == ctx.our.epoch and not target_dead:
                for ref in write.ctx_refs:
                    assert ctx.pool.is_current(ref), (
                        f"S1: CTX block {ref} of {ctx.our.ns} reused under {write}"
                    )
            assert 0 <= write.gen_rank < len(self.gens), f"S1: {write} targets no GEN rank"
            gen = self.gens[write.gen_rank]
            if write.gen_epoch == gen.our.epoch:
                for ref in write.gen_refs:
                    assert gen.pool.is_current(ref), f"S1: GEN block {ref} reused under {write}"

    def check_s4_and_ownership(self) -> None:
        """S4 in every pool, and pool ownership matches the protocol state exactly (no leak)."""
        for rank in self.ranks():
            try:
                rank.pool.check_invariants()
            except ProtocolError as exc:
                raise AssertionError(f"S4: pool of {rank.our.ns}: {exc}") from exc
            counts = rank.pool.counts()
            owned = 0
            for parent, state in rank.parents().items():
                assert rank.pool.holds(parent), (
                    f"no leak: {parent!r} is live ({state.value}) on {rank.our.ns}"
                    " but its pool holds no lease for it"
                )
                owned += len(rank.pool.lease_of(parent))
                assert rank.pool.is_quarantined(parent) == (state is ParentState.QUARANTINED), (
                    f"S4: {parent!r} is {state.value} on {rank.our.ns} but its pool lease is"
                    f" {'' if rank.pool.is_quarantined(parent) else 'not '}quarantined"
                )
            assert counts.leased + counts.quarantined == owned, (
                f"no leak: pool of {rank.our.ns} has {counts}, its live parents own {owned}"
            )
