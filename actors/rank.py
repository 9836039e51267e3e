"""The rank actors: one rank of one instance as a Ray async actor, one class per role.

Theory of operation (docs/design.md "Lifecycle", "Agreement rounds")
---------------------------------------------------------------------------
A rank actor is an I/O shell around one sans-IO protocol object (`CtxRank` or
`GenRank` from `kvhandoff.protocol`) and its `BlockPool`. It makes no protocol
decision itself: every entry point decodes or gathers the event, hands it to
the protocol object in an await-free critical section, and then *performs* the
returned actions (`_perform`): send a frame to a peer rank actor, post a NIXL
WRITE chunk, poison released GEN blocks, feed intents to the next round.

The shell is split by role, with no role branch in it:

- `RankCore`, the common base: identity and directory registration, the
  negotiation, peers and their notices, frames (`receive_frames` and
  `receive_frame` decode, gate and dispatch; `_send`/`_flush` group outgoing
  frames per peer and turn), reports to the coordinator (`_nudge`,
  `_push_report`), the rounds through a `RoundMember` (`_vote`, `_apply`), the
  poll loop's skeleton (`expire` ticks), outcomes (`wait`), `stats`, and
  `_perform` for the actions both roles produce. What differs by role goes
  through hooks the base calls (`_make_side`, `_admit`, `_admitted`,
  `_decided`, `_receive`/`_accept`, `_perform_role`, `_releasing`,
  `_bytes_ok`, `_poll_chunks`, ...), never through a test of the role;
- `CtxRankCore`: admission with a lease deadline, prefill, OPEN checks and
  chunk plans, voting prepared, posting a decided parent's chunks and polling
  them, the conservative path, and the benchmark baselines (`raw_write`,
  `copy_bench`, `transfer_timings`);
- `GenRankCore`: admission with a deadline, install and OPEN on admission
  (`_open`, or `_open_later` once every CTX endpoint is known), byte
  verification (S2) before a completion is voted, decode-ready KV returned on
  `free` (or at once when the submission asked), released blocks poisoned.

`CtxRankActor` and `GenRankActor` are those two as Ray actors;
`rank_actor_class(role)` picks one, and `RankActor.options(...).remote(config,
epoch)` picks by `config.spec.role` (the deployment's rank factory).

A rank holds:
- a `KVBuffer` (one registered region: the rank's block pool memory) and a
  `NixlTransport` whose agent name is unique per endpoint epoch; its buffer
  geometry goes into the directory, so that a CTX rank can check every OPEN
  (its agent is the sender's own, each block descriptor is a whole block of
  that agent's registered buffer) and post its chunks by index from NIXL
  descriptor lists prepared once per edge and peer epoch;
- a `RoundMember` through which its coordinator runs the agreement rounds
  (`round_identity/join/vote/apply` are exposed as actor methods);
- a poll task (owned, cancelled on shutdown) that polls posted chunks (CTX) to
  DONE or ERR and ticks `expire(now)`; it only reports results to the protocol
  object and records intents, never frees memory on its own;
- `peer_restarted`, called by the directory when a peer incarnation is known
  dead: the protocol ends the sessions with it (unproven DMA → UNKNOWN →
  quarantine) instead of waiting for their transfer timeout;
- the protocol negotiation (docs/design.md "Negotiation"): the rank publishes
  its descriptor (`RankConfig.descriptor`, default `local_descriptor()`) with
  its directory entry and, on `connect` and after a peer restart, gathers the
  descriptors of every rank of both instances and lets `agree` decide. Until
  an agreement exists it admits nothing and refuses every frame but an OPEN
  (answered REJECT(NEGOTIATION)) and a REJECT; with one, every frame is
  written in and read against the agreed version, and the CTX runs the active
  cancel protocol only if the agreed capabilities carry it.

Lock and await ordering: the actor runs on one event loop; every handler
mutates protocol state only between awaits (see actors/_member.py and
docs/rounds.md). Frames to peers are submitted with `.remote()` synchronously
inside `_perform`, so frames from this rank to one peer are submitted in the
order the protocol produced them (READY before TERMINAL); the resulting refs are
awaited by owned tasks only to log delivery failures.

Round channels used (protocol/_rounds.py): admissions (every rank leases),
`prepared` → `decided` (CTX: every edge of the parent prepared on every rank:
publish READY and post), completions (intersection: success), cancels and
failures (union). A parent that was cancelled or failed is released per rank
once every local edge has terminal evidence proving quiescence (the evidence
is the proof; no further round is needed for that rank's own blocks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import os
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np
import ray
import torch

from kvhandoff.actors._dataplane import (
    BufferGeometry,
    Chunk,
    ChunkPlan,
    DataPlaneError,
    FaultPlan,
    FaultyTransport,
    KVMemory,
    NixlTransport,
    Piece,
    XferState,
    edge_pieces,
    plan_chunks,
    resolve_regions,
)
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.actors._member import RoundMember, RoundParticipant, VoteNews
from kvhandoff.actors._metrics import RankMetrics, resident_bytes
from kvhandoff.actors._metrics import failed as metrics_failed
from kvhandoff.actors._pattern import POISON, expected_blocks, request_seed
from kvhandoff.actors._staged import StagingArena
from kvhandoff.actors._stager import (
    DATA_MODES,
    StagedReader,
    StagedWriter,
    staged_below,
    staged_min_descriptors,
    staging_slot_bytes,
)
from kvhandoff.actors._trace import (
    TraceEvent,
    TraceRecorder,
    decision_ids,
    proposal_ids,
    rank_actor_name,
)
from kvhandoff.protocol import (
    DEFAULT_QUARANTINE_LIMIT,
    DEFAULT_TRANSFER_TIMEOUT,
    Action,
    AdmissionRequest,
    AdmissionStop,
    BlockColumns,
    BlockDescriptor,
    BlockPool,
    BlockRefs,
    BufferInfo,
    CancelDeferred,
    CancelIntent,
    Capability,
    CleanupSkipped,
    ContextTicket,
    CtxRank,
    DecodeError,
    DecodeReady,
    Drain,
    Endpoint,
    FrameError,
    GenEdgeSpec,
    GenRank,
    LocalOutcome,
    MemoryKind,
    Message,
    Negotiated,
    NegotiationError,
    NegotiationOutcome,
    NotNegotiatedError,
    Open,
    ParentKey,
    ParentSettled,
    ParentState,
    PeerBuffer,
    PoolError,
    PostChunk,
    Prepared,
    ProtocolError,
    Quarantine,
    RankDescriptorV1,
    RankDescriptorV2,
    RankNamespace,
    RecentMemory,
    Release,
    Role,
    RoundDecision,
    RoundProposal,
    RoundVote,
    SendMessage,
    StageAck,
    StageWrite,
    StaleError,
    Step,
    StopPosting,
    UnknownSessionError,
    active_cancel,
    agree,
    apply_step,
    block_columns,
    check_unnegotiated,
    decision_steps,
    decode_frame,
    decode_stage,
    descriptor_frame,
    encode_frame,
    frame_version,
    local_descriptor,
    pack_blocks,
    refusal_kind,
    reject_for,
    whole_block_misfits,
)
from kvhandoff.protocol import summary as negotiation_summary
from kvhandoff.topology import (
    KVLayout,
    TopologySpec,
    block_bytes,
    blocks_for_tokens,
    heads_per_rank,
    memory_pieces,
    shard_map,
    topology_digest,
)

log = logging.getLogger("kvhandoff.rank")

#: Parents whose frames a rank keeps while their admission is not applied
#: here yet (`RankCore._park`); a frame past it is handed to the protocol.
MAX_PARKED = 4096

#: The byte budget of a CTX rank's recent data-phase timings (`transfer_timings`).
_TIMING_BYTES = 1 << 20

__all__ = [
    "RankConfig",
    "RankActor",
    "RankCore",
    "CtxRankCore",
    "GenRankCore",
    "CtxRankActor",
    "GenRankActor",
    "rank_actor_class",
    "agent_name",
    "EndpointHost",
    "ENDPOINT_METHODS",
    "ENDPOINT_GROUP",
    "endpoint_actor",
    "on_endpoint_loop",
]


class RankConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one rank actor needs; the same for every incarnation but `epoch`."""

    deployment: str  # namespace of the named directory actor
    spec: TopologySpec  # our instance
    peer_spec: TopologySpec  # the other side's instance
    layout: KVLayout
    rank: int
    pool_blocks: int
    chunk_bytes: int = 1 << 20
    lease_timeout_s: float = 30.0
    poll_interval_s: float = 0.0005
    device: str = "cpu"
    fault_plan: FaultPlan | None = None
    #: Outside the qualified scope (topology/_gate.py): a cancel never
    #: interrupts a decided transfer; it waits for it to finish, then releases.
    conservative: bool = False
    #: Synthetic prefill and byte verification (S2). Benchmarks of the protocol
    #: and data plane turn it off so they time the handoff, not the pattern.
    synthetic: bool = True
    #: CTX: post chunks from prepared NIXL descriptor lists (built once per edge
    #: and peer epoch) rather than descriptors built per chunk. Same bytes.
    prepared_descriptors: bool = True
    #: GEN: seconds decode-ready KV stays leased for its consumer (free()); past
    #: it the rank returns it (every edge COMPLETED: no writer is left).
    consume_timeout_s: float = 30.0
    #: Share of the pool quarantined at which this rank stops admitting and,
    #: once it holds nothing else, asks its coordinator for a restart (a new
    #: incarnation with a fresh, fully free pool). See docs/design.md.
    quarantine_limit: float = DEFAULT_QUARANTINE_LIMIT
    #: The protocol descriptor this rank advertises (None: `local_descriptor()`,
    #: everything this build speaks). Every rank of both instances negotiates
    #: from all of them (docs/design.md "Negotiation").
    descriptor: RankDescriptorV1 | RankDescriptorV2 | None = None
    #: How control frames travel to peer ranks: "ray" (a one-way actor call
    #: per peer and event-loop turn) or "nixl" (a NIXL notification from our
    #: agent, drained by the poll loop, which then polls every
    #: `poll_interval_s` while a request is live; a peer whose agent we do
    #: not know yet gets the Ray call). docs/benchmarks.md measures both.
    frames: str = "ray"
    #: Whether the coordinator may replace this rank with a new incarnation
    #: (past the quarantine limit). A rank hosted by an engine's own actor is
    #: not ours to restart: it stops admitting instead, and its quarantined
    #: blocks come back only through a proof of quiescence (reclaim).
    restartable: bool = True
    #: Where this rank's KV lives (topology/_memory.py): "blocked", "paged",
    #: "paged_hnd" or "split"; `peer_memory_kind` is the other instance's
    #: (None: the same). The CTX plans its pieces from both.
    memory_kind: str = "blocked"
    peer_memory_kind: str | None = None
    #: How the CTX moves an edge's chunks (docs/design.md "Staged data
    #: plane"): "direct" (one descriptor per piece, straight into the GEN
    #: blocks), "staged" (gather into a slot, one WRITE per slot, the GEN
    #: scatters it) or "auto" (staged for an edge whose pieces average under
    #: `staged_below` bytes, the measured crossover; 0: the device's default).
    #: Any mode but "direct" gives the rank a staging arena of
    #: `staging_window` slots of `staging_slot_bytes` per peer rank,
    #: registered once.
    data_mode: str = "auto"
    staging_window: int = 4
    staged_below: int = 0
    #: Bytes of one staging slot, which is the size of one staged chunk (a
    #: staged edge's chunks are planned at this size, a direct edge's at
    #: `chunk_bytes`). Every staged chunk costs a gather, a WRITE, a notice,
    #: a scatter and an ACK whatever its size, so on a GPU small slots leave
    #: the link idle (docs/benchmarks.md). 0: `staging_slot_default(device,
    #: chunk_bytes)`.
    staging_slot_bytes: int = 0
    #: "auto" stages an edge only from this many descriptors (pieces x
    #: blocks) on; 0: the device's measured default (`STAGED_MIN_DESCRIPTORS`).
    staged_min_descriptors: int = 0
    #: The actor name of this instance's coordinator ("": the pair
    #: deployment's `<deployment>.coord.<role>`).
    coordinator: str = ""
    #: A fleet (docs/design.md "Fleet"): besides `peer_spec`, the rank pairs
    #: with every instance of the other role in the directory's instance
    #: table (read on `connect`, told by `peer_joined` / `peer_left`).
    fleet: bool = False


def agent_name(deployment: str, ns: RankNamespace, epoch: int) -> str:
    """NIXL agent names are unique per endpoint epoch: a restarted rank is a new agent."""
    return f"{deployment}.{ns.instance_id}.{ns.role.value}{ns.rank}.e{epoch}"


class _Pair:
    """What a rank knows of one peer instance (docs/design.md "Fleet"): its
    spec, the pair's digests and shard map, the memory kind of its ranks, and
    the protocol the two instances negotiated (from the descriptors of every
    rank of both; redone when a peer incarnation re-registers)."""

    def __init__(self, ours: TopologySpec, peer: TopologySpec, layout: KVLayout, peer_kind: str) -> None:
        self.spec = peer
        self.instance = peer.instance_id
        ctx_spec, gen_spec = (ours, peer) if ours.role is Role.CTX else (peer, ours)
        self.ctx_digest = topology_digest(ctx_spec)
        self.gen_digest = topology_digest(gen_spec)
        self.peer_digest = topology_digest(peer)
        self.shards = shard_map(layout, ctx_spec.tp, gen_spec.tp)
        self.peer_kind = peer_kind
        self.negotiation: NegotiationOutcome = NotNegotiatedError(0, ours.tp + peer.tp)
        self.seq = [0, 0]  # [queries started, newest answer applied]
        self.negotiating = False  # an owned renegotiation runs (`_renegotiate`)
        self.again = False
        self.unsent: list[tuple[Endpoint, Message]] = []  # sends waiting for the answer
        self.left = False  # the instance left the fleet: nothing new with it


class RankCore(RoundParticipant):
    """What every rank actor does, whatever its role (docstring above). Not an
    actor itself: `CtxRankCore` and `GenRankCore` fill in the role's hooks
    (the methods below that raise `NotImplementedError` or do nothing), and
    `rank_actor_class(role)` is either one as a Ray actor."""

    #: Our instance's role, and the role of the peer instance's ranks.
    role: ClassVar[Role]
    peer_role: ClassVar[Role]
    side: CtxRank | GenRank
    #: Whether a fleet rank may admit a parent before it knows the peer
    #: instance (CTX: an engine publishes before a GEN instance claims the
    #: ticket; its first OPEN binds it). A GEN rank always knows its CTX.
    admits_unpaired: ClassVar[bool] = False

    def __init__(self, config: RankConfig, epoch: int, *, tensors: Sequence[torch.Tensor] | None = None) -> None:
        spec, peer = config.spec, config.peer_spec
        if spec.role is not self.role:
            raise ValueError(f"{type(self).__name__} is a {self.role.value} rank; its config is {spec.role.value}")
        self.config = config
        self.ns = RankNamespace(instance_id=spec.instance_id, role=spec.role, rank=config.rank)
        self.our = Endpoint(ns=self.ns, epoch=epoch)
        self.digest = topology_digest(spec)
        # Hop traces of sampled requests (off until `set_trace`; actors/_trace.py).
        self.trace = TraceRecorder(rank_actor_name(self.ns))
        self._coordinator_actor = f"coord@{spec.instance_id}"
        # Peer instances, by id: the configured one first (the default pair,
        # and the only one outside a fleet); a fleet adds the others.
        default = _Pair(spec, peer, config.layout, config.peer_memory_kind or config.memory_kind)
        self._pairs: dict[str, _Pair] = {peer.instance_id: default}
        self._default_peer = peer.instance_id
        # The default pair's digests and shard map (the staged data plane,
        # which a fleet does not run, and stats use them).
        self.peer_digest = default.peer_digest
        self.ctx_digest = default.ctx_digest
        self.gen_digest = default.gen_digest
        self.shards = default.shards
        # Live parents -> the peer instance each pairs with.
        self._pair_of: dict[ParentKey, str] = {}
        self.block_bytes = block_bytes(config.layout, spec.tp)
        self.local_heads = heads_per_rank(config.layout, spec.tp)
        # Our KV memory: the engine's tensors (checked), or allocated for the synthetic path.
        if tensors is not None:
            self.buffer = KVMemory.from_tensors(config.memory_kind, config.layout, spec.tp, tensors)
            if self.buffer.num_blocks != config.pool_blocks:
                raise DataPlaneError(f"tensors hold {self.buffer.num_blocks} blocks, pool_blocks is {config.pool_blocks}")
        else:
            self.buffer = KVMemory.allocate(config.memory_kind, config.layout, spec.tp, config.pool_blocks, config.device)
        self.pool = BlockPool(config.pool_blocks)
        name = agent_name(config.deployment, self.ns, epoch)
        if config.fault_plan is not None:
            self.transport: NixlTransport = FaultyTransport(name, self.buffer, config.fault_plan)
        else:
            self.transport = NixlTransport(name, self.buffer)
        if config.frames not in ("ray", "nixl"):
            raise ValueError(f"frames must be 'ray' or 'nixl', got {config.frames!r}")
        if config.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode must be one of {DATA_MODES}, got {config.data_mode!r}")
        if config.staging_window <= 0:
            raise ValueError(f"staging_window must be positive, got {config.staging_window}")
        if config.staging_slot_bytes < 0:
            raise ValueError(f"staging_slot_bytes must be 0 (the device's default) or positive, got {config.staging_slot_bytes}")
        # The staging arena: `staging_window` slots per peer rank, one staged chunk each.
        self.arena: StagingArena | None = None
        if config.data_mode != "direct":
            slot_bytes = -(-staging_slot_bytes(config, str(self.buffer.device)) // 8) * 8
            self.arena = StagingArena(config.staging_window * peer.tp, slot_bytes, self.buffer.device)
            self.transport.register_arena(self.arena.tensor)
        # Every NIXL notification is drained by one channel: control frames
        # (frames="nixl") and staging notices (an arena) are told apart there.
        self._channel = NixlNotifChannel(self.transport)
        # Progress our worker at the short interval until then (the bench's raw
        # baselines write into an idle GEN rank; set through __ray_call__).
        self._progress_until = 0.0
        # GPU memory: poll without sleeping during a burst of progress.
        self._hot = self.buffer.mem_kind == "VRAM"
        self._notif = self._channel if config.frames == "nixl" else None
        if self.arena is not None:
            self._channel.stage_sink = []
        # A topology without a transfer timeout (0) is unqualified and runs the
        # conservative path, but L1 still needs a bound: the protocol default.
        timeout = spec.transfer_timeout_s if spec.transfer_timeout_s > 0 else DEFAULT_TRANSFER_TIMEOUT
        self.side = self._make_side(timeout)
        # Rounds carry the instance's topology digest: a proposal or decision
        # of another topology is refused by the follower (S3).
        self.member = RoundMember(config.rank, epoch, self._vote, self._apply, topology_digest=self.digest)
        self._restart_requested = False
        # Peers: (instance id, rank) -> (current endpoint, actor handle), from the directory.
        self._peer_handles: dict[tuple[str, int], tuple[Endpoint, Any]] = {}
        self._coordinator: Any = None
        # Fault injection (tests/actors harness, the chaos demo; set through
        # Ray's __ray_call__, never a method of this actor): frames of request
        # id R to peer (role, rank) wait under (R, role, rank), in order.
        self._held: dict[tuple[str, str, int], list[tuple[Endpoint, bytes]]] = {}
        self._report_due = False
        # Frames produced in this event-loop turn, per peer endpoint (`_flush`).
        self._outbox: dict[Endpoint, tuple[Any, list[bytes]]] = {}
        self._flush_due = False
        # Admitted parents' token counts (GEN: for its OPENs), until their outcome.
        self._tokens: dict[ParentKey, int] = {}
        # Outcomes and waiters (for the client API).
        # Kept while a late `wait` may still ask (protocol `RecentMemory`).
        self._outcome: RecentMemory[ParentKey, LocalOutcome] = RecentMemory()
        self._waiters: dict[ParentKey, list[asyncio.Future[LocalOutcome]]] = collections.defaultdict(list)
        # Waiters for a parent's blocks to be back in the pool (`returned`).
        self._returns: dict[ParentKey, list[asyncio.Future[bool]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # Frames of parents leased in our vote whose admission we have not
        # applied yet (the peer instance heard the decision first), in
        # arrival order; handed to the protocol once the parent left that
        # state (`_replay_parked`).
        self._parked: dict[ParentKey, list[tuple[Message, int]]] = {}
        self._replaying = False
        self._poll_task: asyncio.Task[None] | None = None
        self._stopped: asyncio.Event | None = None  # `watch` returns once set (shutdown)
        self._wake = asyncio.Event()
        self.counters: collections.Counter[str] = collections.Counter()
        # Exported through Ray from the poll loop's expire tick (`_export_metrics`).
        self.metrics = RankMetrics(config.deployment, spec.instance_id, spec.role.value, config.rank)
        self.violations: list[str] = []
        # Negotiation: nothing agreed until connect() (or a frame) gathered every descriptor.
        self._descriptor = descriptor_frame(config.descriptor or local_descriptor())
        self._frame_gate = asyncio.Lock()  # frames waiting for an answer, in arrival order
        self._gate_waiting = 0
        self._register()

    # -- the role's hooks (CtxRankCore, GenRankCore) ---------------------------------

    def _ctx_and_gen(self) -> tuple[TopologySpec, TopologySpec]:
        """The CTX instance's spec and the GEN instance's spec (ours and our peer's)."""
        raise NotImplementedError

    def _make_side(self, transfer_timeout: float) -> CtxRank | GenRank:
        """The protocol object of our role, over our pool."""
        raise NotImplementedError

    def _admit(self, request: AdmissionRequest, blocks: int, now: float, deadline: float, pair: _Pair | None) -> None:
        """Lease `blocks` for a proposed admission tentatively (in our vote),
        paired with the peer instance `pair` (None: not known yet, see
        `admits_unpaired`); a refusal raises (`PoolError`, or whatever the
        admission carries)."""
        raise NotImplementedError

    def _admitted(self, parent: ParentKey, now: float) -> None:
        """The round admitted `parent` in this instance (its apply)."""
        raise NotImplementedError

    def _decided(self, parent: ParentKey, now: float) -> None:
        """The round decided `parent` (every edge prepared on every rank)."""

    def _receive(self, message: Message, now: float) -> list[Action]:
        """Hand an agreed frame to the protocol (raises `ProtocolError` if refused)."""
        return self.side.receive(message, now)  # type: ignore[arg-type]

    async def _accept(self, message: Message, actions: list[Action]) -> None:
        """Perform what an accepted frame produced."""
        self._perform(actions)

    def _perform_role(self, action: Action, now: float) -> list[Any]:
        """Perform an action only our role's protocol produces (`_perform`)."""
        return []

    def _releasing(self, parent: ParentKey, blocks: tuple[Any, ...]) -> None:
        """`parent`'s `blocks` go back to our pool (before its outcome is recorded)."""

    def _bytes_ok(self, parent: ParentKey) -> bool:
        """Whether the bytes of `parent`, settled without a cancel, may complete."""
        return True

    def _poll_chunks(self, now: float) -> bool:
        """Poll what we posted; whether any of it finished (the poll loop)."""
        return False

    def _chunks_in_flight(self) -> int:
        """How many posted chunks are not DONE or ERR yet."""
        return 0

    def _forget(self, parent: ParentKey) -> None:
        """Drop the role's per-request bookkeeping of `parent` (it has its outcome)."""

    def _tracking(self) -> int:
        """How much role-specific per-request bookkeeping is held (`stats`)."""
        return 0

    def _conservative(self) -> bool:
        """Whether this rank runs the conservative cancel path (`stats`)."""
        raise NotImplementedError

    def _negotiated(self, outcome: NegotiationOutcome) -> None:
        """A (newer) negotiation answer was applied."""

    def _learn_agent(self, name: str, metadata: Any, geometry: BufferGeometry) -> None:
        """The directory gave us peer agent `name`, its NIXL metadata and buffer."""
        if (self._notif is not None or self.arena is not None) and name not in self.transport.peers:
            self.transport.add_peer(metadata)  # frames (and staging ACKs) go to it as notifications

    # -- identity, directory, peers ---------------------------------------------

    def _directory(self) -> Any:
        return ray.get_actor(f"{self.config.deployment}.directory")

    def _register(self) -> None:
        geometry = self.buffer.geometry()
        if self.arena is not None:
            geometry = geometry._replace(staging=(self.arena.base, self.arena.slot_bytes, self.config.staging_window))
        entry = (self.our, self.transport.name, self.transport.metadata(), geometry)
        context = ray.get_runtime_context()
        where = (context.get_node_id(), os.getpid())  # to confirm this process's death later
        # Fire-and-forget: the directory only stores it; lookups wait for it.
        self._own(
            self._directory().register.remote(
                self.role.value, self.config.rank, entry, context.current_actor, where,
                descriptor=self._descriptor,
            )
        )

    # -- negotiation (the decisions are protocol/_negotiation.py's) ----------------

    @property
    def _negotiation(self) -> NegotiationOutcome:
        """The default pair's agreement (outside a fleet: the only one)."""
        pair = self._pairs.get(self._default_peer)
        return pair.negotiation if pair is not None else NotNegotiatedError(0, 1)

    async def _negotiate(self, pair: _Pair) -> NegotiationOutcome:
        """Gather the descriptor of every rank of both instances of `pair` from
        the directory (ours from our config), let `agree` decide, apply the answer."""
        pair.seq[0] += 1
        seq = pair.seq[0]
        known = await self._directory().descriptors.remote()
        known[(self.ns.instance_id, self.config.rank)] = self._descriptor
        # The same order on every rank of both instances (CTX ranks, then GEN
        # ranks): same frames, same answer, and the same words in a refusal.
        specs = (self.config.spec, pair.spec) if self.role is Role.CTX else (pair.spec, self.config.spec)
        frames = [known.get((s.instance_id, r)) for s in specs for r in range(s.tp)]
        outcome: NegotiationOutcome
        try:
            outcome = agree(frames)
        except NegotiationError as exc:
            outcome = exc
        if seq > pair.seq[1]:  # an older, slower query never replaces a newer answer
            pair.seq[1] = seq
            before = negotiation_summary(pair.negotiation)
            pair.negotiation = outcome
            self._negotiated(outcome)
            if negotiation_summary(outcome) != before:
                log.info("rank %s: negotiation with %s: %s", self.ns, pair.instance, negotiation_summary(outcome))
        return pair.negotiation

    def _renegotiate(self, pair: _Pair) -> None:
        """Negotiate `pair` again in an owned task (once more if asked while one
        runs); then send what waited for the answer, in order."""
        if pair.negotiating:
            pair.again = True
            return
        pair.negotiating = True

        async def run() -> None:
            try:
                pair.again = True
                while pair.again:
                    pair.again = False
                    await self._negotiate(pair)
            finally:
                pair.negotiating = False
                unsent, pair.unsent = pair.unsent, []
                for to, message in unsent:
                    frame = self._encode(message)
                    if frame is not None:
                        self._send(to, frame)

        self._own(run())

    async def _await_agreement(self, pair: _Pair) -> None:
        """A frame came before an agreement (a restarted rank's first moments):
        negotiate now. Frames wait in arrival order (the lock is FIFO, and a
        frame that comes while others wait queues behind them)."""
        self._gate_waiting += 1
        try:
            async with self._frame_gate:
                if isinstance(pair.negotiation, NotNegotiatedError):
                    await self._negotiate(pair)
        except Exception as exc:  # the directory did not answer: still no agreement, refused
            self.counters["negotiation_lookup_failed"] += 1
            log.warning("rank %s: negotiation failed: %r", self.ns, exc)
        finally:
            self._gate_waiting -= 1

    def _peer_ns(self, ticket: ContextTicket) -> RankNamespace:
        """The peer rank a ticket names, seen from our role."""
        return ticket.gen.ns if self.role is Role.CTX else ticket.ctx.ns

    def _pair_for(self, message: Message) -> _Pair:
        """The pair a received frame belongs to: the peer instance its ticket
        names. A frame naming an instance we do not pair with is refused."""
        ticket = getattr(message, "ticket", None)
        if not isinstance(ticket, ContextTicket):  # e.g. a descriptor frame: not a control frame
            raise UnknownSessionError(f"a {type(message).__name__} is not a control frame for a session")
        ns = self._peer_ns(ticket)
        pair = self._pairs.get(ns.instance_id)
        if pair is None or ns.role is not self.peer_role:
            raise UnknownSessionError(f"{ns.role.value} instance {ns.instance_id!r} does not pair with {self.ns.instance_id!r}")
        return pair

    def _check_agreed(self, pair: _Pair, message: Message, version: int) -> None:
        """With the pair's agreement, a frame of another version is refused
        (`FrameError`); without one every frame but a REJECT is refused, typed
        (an OPEN addressed to us is then answered REJECT(NEGOTIATION))."""
        outcome = pair.negotiation
        if isinstance(outcome, Negotiated):
            if version != outcome.version:
                raise FrameError(f"frame is protocol v{version} but v{outcome.version} was negotiated")
            return
        try:
            check_unnegotiated(outcome, message)
        except NegotiationError as exc:
            self.counters[f"refused_negotiation_{refusal_kind(exc)}"] += 1
            raise

    def _encode(self, message: Message, answering: int | None = None) -> bytes | None:
        """Encode in the pair's agreed version; without an agreement only an
        OPEN or a REJECT (in the version of the frame it answers) is written;
        anything else is not sent (counted)."""
        pair = self._pairs.get(self._peer_ns(message.ticket).instance_id)  # type: ignore[union-attr]
        outcome = pair.negotiation if pair is not None else NotNegotiatedError(0, 1)
        try:
            version = frame_version(outcome, message, answering=answering)
            return encode_frame(message, version=version)
        except NegotiationError as exc:
            self.counters[f"unsent_negotiation_{refusal_kind(exc)}"] += 1
            return None

    async def _peer(self, their: Endpoint) -> Any:
        key = (their.ns.instance_id, their.ns.rank)
        cached = self._peer_handles.get(key)
        if cached is not None and cached[0] == their:
            return cached[1]
        # Wait (bounded) for `their` incarnation: its first frame can come
        # before its registration reaches the directory (a rank that just
        # joined or restarted), and the entry there is then an older one.
        found = await self._directory().lookup.remote(key[0], key[1], their.epoch, self.config.lease_timeout_s)
        if found is None:
            raise UnknownSessionError(f"no rank actor registered for {their}")
        (endpoint, name, metadata, geometry), handle = found
        self._peer_handles[key] = (endpoint, handle)
        self._learn_agent(name, metadata, geometry)
        if endpoint != their:
            return None  # the peer restarted: the message is stale
        return handle

    async def connect(self) -> list[Endpoint]:
        """Learn every current peer endpoint of the default pair (and, on CTX,
        its NIXL agents) and negotiate with it; in a fleet, also learn every
        instance of the other role from the directory's instance table and
        negotiate with each (their agents are loaded on first use)."""
        directory = self._directory()
        if self.config.fleet:
            listed = await directory.instances.remote()
            present = {spec.instance_id for spec, _ in listed}
            for spec, kind in listed:
                self._add_pair(spec, kind)
            for instance in [i for i in self._pairs if i not in present]:
                self._drop_pair(instance)  # left while we were away
        endpoints = []
        if self._default_peer in self._pairs:
            for (endpoint, name, metadata, geometry), handle in await directory.all_of.remote(self._default_peer):
                self._peer_handles[(endpoint.ns.instance_id, endpoint.ns.rank)] = (endpoint, handle)
                self._learn_agent(name, metadata, geometry)
                endpoints.append(endpoint)
        # Every rank has registered by now (or is being restarted).
        await asyncio.gather(*(self._negotiate(pair) for pair in list(self._pairs.values())))
        self._export_metrics(time.monotonic())  # the pool gauges, before any traffic
        return endpoints

    # -- the fleet: pairs with instances that join and leave --------------------------

    def _add_pair(self, spec: TopologySpec, kind: str) -> _Pair | None:
        """Pair with instance `spec` (of the other role) if we do not yet."""
        if spec.role is not self.peer_role or spec.instance_id in self._pairs:
            return self._pairs.get(spec.instance_id)
        pair = self._pairs[spec.instance_id] = _Pair(self.config.spec, spec, self.config.layout, kind)
        self.counters["pairs_added"] += 1
        return pair

    def _drop_pair(self, instance: str) -> None:
        """Forget instance `instance`: no new admission pairs with it; its NIXL
        agents are unloaded once no live parent pairs with it (a WRITE may be
        in flight toward, or from, an agent until then)."""
        pair = self._pairs.get(instance)
        if pair is None:
            return
        if not pair.left:
            pair.left = True
            # Whatever still pairs with it ends now, not at a deadline: a
            # drained instance has none; a dead one leaves its handoffs
            # behind. A cancel intent: the round decides, the protocol
            # drains or proves what is in flight (nothing is freed here).
            for parent in [p for p, peer in self._pair_of.items() if peer == instance]:
                self.member.record_cancel(parent)
                self.counters["cancelled_peer_left"] += 1
                self._nudge()
        if any(peer == instance for peer in self._pair_of.values()):
            return  # unloaded when the last parent with it ends (`_finish`)
        if self._writing_to(instance):
            # A WRITE toward it is not polled to DONE or ERR yet (a parent
            # quarantined on it has ended here, its chunks have not). Its
            # agent stays loaded until the last one ends: unloading a peer
            # under a transfer is no abort, and that handle would never end,
            # so neither would the quarantine it keeps (the poll retries).
            self.counters["unload_deferred_in_flight"] += 1
            return
        del self._pairs[instance]
        for key in [k for k in self._peer_handles if k[0] == instance]:
            del self._peer_handles[key]
        # Every agent of the instance, older incarnations' included (a
        # `peer_restarted` notice forgets the handle, not the loaded agent).
        prefix = f"{self.config.deployment}.{instance}."
        for name in sorted(n for n in self.transport.peers if n.startswith(prefix)):
            self.transport.remove_peer(name)
            self.counters["agents_unloaded"] += 1
        self._pair_left(instance)
        self.counters["pairs_removed"] += 1

    def _pair_left(self, instance: str) -> None:
        """The role's own per-pair state of `instance` goes (its pair was dropped)."""

    def _writing_to(self, instance: str) -> bool:
        """Whether a WRITE we posted toward a rank of `instance` is not yet
        polled to DONE or ERR (or a chunk toward it waits to be posted)."""
        return False

    def _drop_left_pairs(self) -> None:
        """Retry unloading pairs that left while WRITEs toward them ran."""
        for instance in [i for i, p in self._pairs.items() if p.left]:
            self._drop_pair(instance)

    async def peer_joined(self, spec: TopologySpec, kind: str) -> bool:
        """The directory says instance `spec` joined the fleet: pair with it
        and negotiate (its ranks registered their descriptors before it was
        added). Refused (False) outside a fleet, for our own role, or when
        the instance is known already."""
        if not self.config.fleet or spec.role is not self.peer_role or spec.instance_id in self._pairs:
            self.counters["refused_peer_joined"] += 1
            return False
        pair = self._add_pair(spec, kind)
        assert pair is not None
        await self._negotiate(pair)
        return True

    async def peer_left(self, instance: str) -> bool:
        """The directory says instance `instance` left the fleet (drained, or
        removed after its death): admit nothing more with it and unload its
        agents once nothing with it is live."""
        if instance not in self._pairs:
            return False
        self._drop_pair(instance)
        return True

    async def paired_with(self, instance: str) -> int:
        """How many live parents here pair with peer instance `instance` (a
        drain waits for 0 on every rank of the other role)."""
        return sum(1 for peer in self._pair_of.values() if peer == instance)

    async def pairs(self) -> dict[str, Any]:
        """Every pair: the peer instance's TP, whether it left, the agreement."""
        return {
            i: {"tp": p.spec.tp, "left": p.left, "negotiated": negotiation_summary(p.negotiation)}
            for i, p in self._pairs.items()
        }

    async def peer_restarted(self, their: Endpoint) -> int:
        """The directory saw a peer rank come back as `their` (a newer epoch):
        our sessions with its older incarnations can never finish. The protocol
        decides what that means (edges with unproven DMA become UNKNOWN and
        their blocks quarantined; the rest are cancelled); returns the number
        of actions it produced. A notice that is not about a peer rank of ours,
        or about an epoch we already know, changes nothing."""
        if not self._about_a_peer(their, "peer_restarted"):
            return 0
        key = (their.ns.instance_id, their.ns.rank)
        cached = self._peer_handles.get(key)
        if cached is not None and cached[0].epoch < their.epoch:
            del self._peer_handles[key]  # the next send resolves the new incarnation
        self._renegotiate(self._pairs[their.ns.instance_id])  # it re-registers with its descriptor
        return self._perform_notice(self.side.peer_restarted(their, time.monotonic()), "peer_restarts_seen")

    def _about_a_peer(self, endpoint: Endpoint, notice: str) -> bool:
        """A notice names a rank of our peer instance, or it is refused (counted)."""
        if endpoint.ns.role is self.peer_role and endpoint.ns.instance_id in self._pairs:
            return True
        self.counters[f"refused_{notice}"] += 1
        return False

    def _perform_notice(self, actions: list[Action], seen: str) -> int:
        self.counters[seen] += 1
        self._perform(actions)
        self._ensure_polling()
        return len(actions)

    def _find_coordinator(self) -> bool:
        if self._coordinator is None:
            name = self.config.coordinator or f"{self.config.deployment}.coord.{self.role.value}"
            try:
                self._coordinator = ray.get_actor(name)
            except ValueError:  # not up yet: the next round carries the news anyway
                return False
        return True

    async def peer_dead(self, dead: Endpoint) -> int:
        """The directory reports peer incarnation `dead` confirmed dead (its
        coordinator killed it and Ray reported the actor gone). On GEN that is
        the proof that nothing it posted can still land: its edges, UNKNOWN ones
        included, are quiescent, and quarantined requests that waited only on
        it are reclaimed. On CTX it ends the quarantine of edges toward it
        whose WRITEs all ended at their poll (an ERR of several descriptors
        included: the rest can land only in the dead process). Refused like
        `peer_restarted` when not about a peer."""
        if not self._about_a_peer(dead, "peer_dead"):
            return 0
        return self._perform_notice(self.side.peer_dead(dead, time.monotonic()), "peer_deaths_seen")

    def _nudge(self) -> None:
        """Push our news to the coordinator (one way: ranks never await rounds).

        Coalesced: every intent recorded in this turn of the event loop goes
        out in one `RankReport`, sent when the turn ends."""
        if self._report_due:
            return
        self._report_due = True
        if _loop_running():
            asyncio.get_running_loop().call_soon(self._push_report)
        else:
            self._push_report()

    def _push_report(self) -> None:
        self._report_due = False
        if not self._find_coordinator():
            return  # not up yet: the next vote carries the news anyway
        self.counters["reports_sent"] += 1
        self._own(self._coordinator.report.remote(self.member.report()))

    def _own(self, awaitable: Any) -> None:
        """Keep a reference to a fire-and-forget call; log if it fails."""

        async def watch() -> None:
            try:
                await awaitable
            except Exception as exc:  # delivery failure: the protocol's timeouts handle it
                self.counters["send_failures"] += 1
                log.warning("rank %s: call failed: %r", self.ns, exc)

        task = asyncio.get_running_loop().create_task(watch()) if _loop_running() else None
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- rounds -------------------------------------------------------------------

    def _vote(self, proposal: RoundProposal) -> VoteNews:
        now = time.monotonic()
        deadline = now + self.config.lease_timeout_s
        ok = []
        stopped = self.side.admission_stopped()
        for request in proposal.admissions:
            if stopped:
                self.counters["admit_refused_stopped"] += 1
                continue
            peer = request.peer_instance or ("" if self.config.fleet else self._default_peer)
            pair = self._pairs.get(peer) if peer else None
            if (pair is None and (peer or not self.admits_unpaired)) or (pair is not None and pair.left):
                # An instance we do not pair with (unknown, or it left): refused.
                self.counters["refused_unknown_instance"] += 1
                continue
            # No agreed protocol with that instance: admit nothing (refused
            # before any lease or DMA). An unpaired admission (a published
            # engine ticket) is checked against its pair at its first OPEN.
            if pair is not None and not isinstance(pair.negotiation, Negotiated):
                refusal = refusal_kind(pair.negotiation)
                if refusal == "pending":
                    self._renegotiate(pair)
                self.counters[f"refused_negotiation_{refusal}"] += 1
                continue
            try:
                n = blocks_for_tokens(self.config.layout, request.num_tokens)
                self._admit(request, n, now, deadline, pair)
            except PoolError:
                self.counters["admit_refused"] += 1
                continue
            except Exception as exc:
                # Whatever one admission carries (a size no layout accepts, ...),
                # it refuses that admission only; it never breaks the rank.
                self.counters[f"admit_refused_{type(exc).__name__}"] += 1
                log.warning("rank %s: admission of %s refused: %r", self.ns, request.parent, exc)
                continue
            self._tokens[request.parent] = request.num_tokens
            if peer:
                self._pair_of[request.parent] = peer
            ok.append(request.parent)
        return VoteNews(admit_ok=tuple(ok))

    def _apply(self, decision: RoundDecision) -> None:
        now = time.monotonic()
        parents = self.side.parents()
        for step, parent in decision_steps(decision, parents):
            # What each step means is the protocol's (`apply_step`); here only
            # what the shell adds: the role's work after an admission, the
            # CTX's decide, and what it counts and remembers.
            if step is Step.ADMITTED:
                self._admitted(parent, now)
                continue
            if step is Step.DECIDED:
                self._decided(parent, now)
                continue
            if step is Step.WITHDRAW:
                # Leased tentatively in our vote, not admitted (another rank
                # refused, or the round timed out): nothing was exposed.
                self._outcome.remember(parent, LocalOutcome.REJECTED, now)
            elif step is Step.CANCELLED:
                self.metrics.cancelled(parents[parent].value)
            self._perform(apply_step(self.side, step, parent, now))
        alive = self.side.parents()
        self.member.follower.forget(alive.__contains__)
        self._replay_parked()
        self._wake.set()

    # -- the control plane ------------------------------------------------------------

    async def receive_frames(self, frames: list[bytes]) -> int:
        """Control frames from one peer rank, in the order it produced them
        (one one-way call per peer and event-loop turn). Each is handled as
        `receive_frame` handles it; returns how many were accepted."""
        accepted = 0
        for frame in frames:
            accepted += bool(await self.receive_frame(frame))
        return accepted

    async def receive_frame(self, frame: bytes) -> bool:
        """A control frame from a peer rank. Returns whether it was accepted."""
        return await self._receive_frame(frame, "call")

    async def _receive_frame(self, frame: bytes, carrier: str) -> bool:
        message = None
        try:
            # Any version this build reads; the pair's agreed one is checked
            # once the ticket says which pair the frame belongs to.
            message = decode_frame(frame)
            if self.trace.every:
                self._trace_frame(message, carrier)
            pair = self._pair_for(message)
            if self._gate_waiting or not isinstance(pair.negotiation, Negotiated):
                await self._await_agreement(pair)
            self._check_agreed(pair, message, frame[4])
        except ProtocolError as exc:
            self._refused(message, exc, frame[4])
            return False
        if self._park(message, frame[4]):
            return True
        return await self._deliver(message, frame[4])

    async def _deliver(self, message: Message, version: int) -> bool:
        """Hand an agreed frame to the protocol and perform what it produced."""
        try:
            actions = self._receive(message, time.monotonic())
        except ProtocolError as exc:
            self._refused(message, exc, version)
            return False
        await self._accept(message, actions)
        return True

    def _refused(self, message: Message | None, exc: ProtocolError, version: int) -> None:
        """A frame refused: nothing changed (S3), counted. Late RECEIPTs for
        released parents land here too."""
        self.counters[f"refused_{type(exc).__name__}"] += 1
        if isinstance(message, Open):  # a refused proposal addressed to us gets a typed REJECT
            reject = reject_for(message, exc, self.our)
            encoded = None if reject is None else self._encode(reject, answering=version)
            if encoded is not None:  # written in the OPEN's version when none is agreed
                self.counters["frames_reject"] += 1
                self._send(message.ticket.gen, encoded, message.ticket.request_id)
            else:
                self.counters["refused_open_not_ours"] += 1

    def _park(self, message: Message, version: int) -> bool:
        """Keep a frame of a parent we leased in our vote but whose admission
        we have not applied yet; whether it was kept. The peer instance's
        coordinator hears our round's decision before we apply it, so the
        peer's OPEN can come first: it waits here, in arrival order with
        any frame after it, until the apply (or the lease's end) moves the
        parent on. Bounded: past `MAX_PARKED` parents a frame is not kept
        (the protocol refuses it as before)."""
        ticket = getattr(message, "ticket", None)
        if not isinstance(ticket, ContextTicket):
            return False
        parent = ticket.parent
        queue = self._parked.get(parent)
        if queue is None:
            if len(self._parked) >= MAX_PARKED or not self._leased_unapplied(parent):
                return False
            queue = self._parked[parent] = []
        queue.append((message, version))
        self.counters["frames_parked"] += 1
        return True

    def _leased_unapplied(self, parent: ParentKey) -> bool:
        """Whether `parent` is leased in our vote and its admission not applied."""
        return self.side.live_state(parent) is ParentState.ADMITTED

    def _replay_parked(self) -> None:
        """Parents that left the leased-in-vote state get their parked frames
        (one task at a time, so frames keep their order)."""
        if self._parked and not self._replaying and _loop_running():
            self._replaying = True
            self._own(self._replay())

    async def _replay(self) -> None:
        try:
            while True:
                ready = [p for p in self._parked if not self._leased_unapplied(p)]
                if not ready:
                    return
                for parent in ready:
                    queue = self._parked[parent]
                    while queue:  # a frame that comes meanwhile joins the queue
                        message, version = queue.pop(0)
                        await self._deliver(message, version)
                    del self._parked[parent]
        finally:
            self._replaying = False

    def _trace_frame(self, message: Message, carrier: str) -> None:
        ticket = getattr(message, "ticket", None)
        if isinstance(ticket, ContextTicket):
            sender = ticket.gen.ns if self.role is Role.CTX else ticket.ctx.ns
            what = f"frame:{type(message).__name__}"
            self.trace.record(ticket.request_id, what, carrier, rank_actor_name(sender))

    async def set_trace(self, every: int) -> None:
        """Trace one request in `every` from now on (0: off); actors/_trace.py."""
        self.trace.set_every(every)

    async def trace_events(self, request_id: str) -> list[TraceEvent]:
        """This rank's events of a traced request (forgotten here once taken)."""
        return self.trace.take(request_id)

    async def phase(self, parent: ParentKey) -> dict[str, Any]:
        """The parent's local state and its edges' states (for tests and the demo)."""
        state = self.side.live_state(parent)
        edges = self.side.edges(parent) if state is not None else {}
        return {
            "state": state.value if state is not None else self._outcome.get(parent),
            "edges": sorted(e.state.value for e in edges.values()),
            "posted": sum(e.posted for e in edges.values()),
            "in_flight": sum(len(e.in_flight) for e in edges.values()),
        }

    # -- performing actions --------------------------------------------------------------

    def _perform(self, actions: list[Action]) -> list[Any]:
        refs: list[Any] = []
        now = time.monotonic()
        for action in actions:
            match action:
                case SendMessage(to=to, message=message):
                    refs.append(self._send(to, message))
                case StopPosting() | Drain():
                    self._wake.set()  # the poll loop drains what is posted
                case Release(parent=parent, blocks=blocks, reclaimed=reclaimed):
                    self._releasing(parent, blocks)
                    if reclaimed:
                        self.counters["reclaimed"] += 1
                        self.counters["reclaimed_blocks"] += len(blocks)
                        log.info("rank %s reclaimed %d quarantined blocks of %s", self.ns, len(blocks), parent)
                    else:
                        self.counters["released"] += 1
                    self._finish(parent, action.outcome)
                    for future in self._returns.pop(parent, ()):
                        if not future.done():
                            future.set_result(True)
                case Quarantine(parent=parent, reason=reason):
                    self.counters["quarantined"] += 1
                    log.warning("rank %s quarantined %s: %s", self.ns, parent, reason)
                    self._finish(parent, action.outcome)
                case AdmissionStop(parent=parent, reason=reason):
                    self.counters["admission_stop"] += 1
                    self.member.record_failure(parent)
                    self._nudge()
                case CancelIntent(parent=parent):
                    self.member.record_cancel(parent)
                    self._nudge()
                case ParentSettled(parent=parent, cancelled=cancelled, evidence=evidence):
                    self._settled(parent, cancelled, evidence)
                case CleanupSkipped():
                    self.counters["cleanup_skipped"] += 1
                case CancelDeferred():
                    self.counters["cancel_deferred"] += 1
                case _:  # PostChunk and Prepared (CTX), DecodeReady (GEN)
                    refs += self._perform_role(action, now)
        self._maybe_request_restart()
        return [r for r in refs if r is not None]

    def _maybe_request_restart(self) -> None:
        """Past the quarantine limit, with nothing but quarantined requests left:
        ask the coordinator for a restart, once per incarnation. The new
        incarnation has a new process, buffer and NIXL registration (a fresh,
        fully free pool); the old one's quarantined memory dies with it. A
        request the coordinator does not grant (it is recovering) is asked
        again later: the poll loop performs `expire` every 50 ms."""
        if self._restart_requested or not self.config.restartable or not self.side.wants_restart():
            return  # live requests first finish (admission is stopped meanwhile)
        if self._coordinator is None and not self._find_coordinator():
            return
        self._restart_requested = True
        quarantined = self.pool.counts().quarantined
        self.counters["restart_requested"] += 1
        log.warning("rank %s: %d blocks quarantined, asking for a restart", self.ns, quarantined)
        request = self._coordinator.request_restart.remote(self.config.rank, self.our.epoch, quarantined)

        async def ask() -> None:
            try:
                granted = await request
            except Exception as exc:
                log.warning("rank %s: restart request failed: %r", self.ns, exc)
                granted = False
            if not granted:
                self._restart_requested = False

        self._own(ask())

    def _send(self, to: Endpoint, frame: bytes | Message, request_id: str = "") -> Any:
        if not isinstance(frame, bytes):  # a message: encode it in the pair's agreed version
            pair = self._pairs.get(to.ns.instance_id)
            if pair is not None and (isinstance(pair.negotiation, NotNegotiatedError) or pair.unsent):
                pair.unsent.append((to, frame))  # sent, in order, once negotiated
                self._renegotiate(pair)
                return None
            request_id = frame.ticket.request_id
            self.counters[f"frames_{type(frame).__name__.lower()}"] += 1
            encoded = self._encode(frame)
            if encoded is None:
                return None
            frame = encoded
        if self._held:
            held = self._held.get((request_id, to.ns.role.value, to.ns.rank))
            if held is not None:  # fault injection: the frame is delayed, in order
                held.append((to, frame))
                return None
        self.counters["frames_sent"] += 1
        if self._notif is not None:
            agent = agent_name(self.config.deployment, to.ns, to.epoch)
            if agent in self.transport.peers and self._notif.send(agent, frame):
                self.counters["frames_nixl"] += 1
                return None
        cached = self._peer_handles.get((to.ns.instance_id, to.ns.rank))
        if cached is not None and cached[0] == to:
            # Group the frames of this event-loop turn per peer: one one-way
            # call carries them all, in the order they were produced.
            box = self._outbox.get(to)
            if box is None:
                box = self._outbox[to] = (cached[1], [])
                if _loop_running():
                    if not self._flush_due:
                        self._flush_due = True
                        asyncio.get_running_loop().call_soon(self._flush)
                    box[1].append(frame)
                    return None
            box[1].append(frame)
            if not _loop_running():
                self._flush()
            return None
        # Unknown or restarted peer: resolve it, then send (a stale endpoint is dropped).
        async def resolve_and_send() -> None:
            handle = await self._peer(to)
            if handle is None:
                self.counters["dropped_stale_sends"] += 1
                return
            await handle.receive_frames.remote([frame])

        self._own(resolve_and_send())
        return None

    def _flush(self) -> None:
        """Send every peer's grouped frames: one one-way call per peer."""
        self._flush_due = False
        boxes, self._outbox = self._outbox, {}
        for handle, frames in boxes.values():
            self.counters["frame_calls"] += 1
            self._own(handle.receive_frames.remote(frames))

    def _settled(self, parent: ParentKey, cancelled: bool, evidence: Any) -> None:
        """Every local edge of `parent` is terminal. A cancelled parent is released
        by the protocol once its cancel is decided; a success feeds the completion
        round (GEN verifies every byte first: S2, `_bytes_ok`)."""
        if cancelled:
            self._outcome.setdefault(parent, LocalOutcome.CANCELLED, time.monotonic())
            return
        if not self._bytes_ok(parent):
            self.member.record_failure(parent)
            self._outcome.remember(parent, LocalOutcome.FAILED, time.monotonic())
        else:
            self.member.record_completion(parent)
        self._nudge()

    # -- synthetic prefill (CTX) and verification (GEN): S2 ------------------------------

    def _pattern(self, parent: ParentKey, rank: int, n: int) -> torch.Tensor:
        layout = self.config.layout
        return expected_blocks(
            request_seed(parent.request_id, parent.ctx_attempt),
            num_layers=layout.num_layers,
            local_heads=self.local_heads,
            head_offset=rank * self.local_heads,
            tokens_per_block=layout.tokens_per_block,
            row_bytes=layout.head_dim * layout.dtype_bytes,
            first_block=0,
            num_blocks=n,
        )

    # -- the poll loop -----------------------------------------------------------------------

    def _ensure_polling(self) -> None:
        self._wake.set()
        if self._poll_task is None or self._poll_task.done():
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        """Poll posted chunks to DONE/ERR and tick deadlines. Reports results only."""
        last_expire = 0.0
        last_progress = 0.0
        idle_sweeps = 0  # sweeps in a row where no chunk finished: back off
        while True:
            try:
                now = time.monotonic()
                progressed = self._poll_chunks(now)
                # Drains notifications (frames, staging notices) and progresses
                # our NIXL worker: agents run without a progress thread.
                for _, frame in self._channel.poll():
                    progressed = True
                    if self._notif is not None:
                        await self._receive_frame(frame, "notif")
                    else:
                        self.counters["nixl_frames_unexpected"] += 1
                staged = self._channel.stage_sink
                while staged:
                    progressed = True
                    sender, payload = staged.pop(0)
                    self._on_stage(sender, payload, time.monotonic())
                if now - last_expire > 0.05:
                    last_expire = now
                    self._perform(self.side.expire(now))
                    self._replay_parked()  # a lease that ran out before its apply came
                    if self.metrics.due(now):
                        self._export_metrics(now)
                idle_sweeps = 0 if progressed else idle_sweeps + 1
                if (self._notif is not None and self.side.any_live()) or self._stage_polling():
                    # Frames arrive only when polled: poll at the short interval
                    # while a request is live (an empty poll costs a few µs). On
                    # a GPU, a chunk takes ~0.1 ms: within 2 ms of the last
                    # progress the loop only yields (a burst), then backs off.
                    if progressed:
                        last_progress = now
                    hot = self._hot and now - last_progress < 0.002
                    await asyncio.sleep(0 if hot else self.config.poll_interval_s)
                elif self._chunks_in_flight():
                    # Stuck chunks (e.g. of a quarantined lease) are kept and polled, never
                    # released: back off from 0.5 ms to 50 ms so they cost no CPU.
                    await asyncio.sleep(min(self.config.poll_interval_s * (1 << min(idle_sweeps // 64, 7)), 0.05))
                else:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except Exception:
                # A sweep that raised is a bug (a transport or the protocol
                # broke a promise): count it, say it, and keep polling. A
                # dead loop would leave every chunk and frame of this rank
                # unpolled, each request to its watchdog.
                self._poll_failed()
                await asyncio.sleep(self.config.poll_interval_s)

    def _poll_failed(self) -> None:
        self.counters["poll_loop_errors"] += 1
        if self.counters["poll_loop_errors"] == 1 or self.counters["poll_loop_errors"] % 1000 == 0:
            log.exception(
                "rank %s: a poll sweep raised (%d so far); the loop goes on",
                self.ns, self.counters["poll_loop_errors"],
            )

    def _on_stage(self, sender: str, payload: bytes, now: float) -> None:
        """A staging notice (a WRITE's, or an ACK) drained from NIXL."""
        try:
            notice = decode_stage(payload)
        except DecodeError as exc:
            self.counters["staged_undecodable"] += 1
            log.warning("rank %s: undecodable staging notice from %s: %s", self.ns, sender, exc)
            return
        self._stage_notice(sender, notice, now)

    def _stage_notice(self, sender: str, notice: Any, now: float) -> None:
        self.counters["staged_misdirected"] += 1

    def _stage_polling(self) -> bool:
        """Whether to poll at the short interval: staging notices are due, or
        our NIXL worker must progress (agents run without a progress thread,
        which spun a core per rank: a WRITE target progresses in this loop)."""
        return time.monotonic() < self._progress_until

    # -- outcomes, stats -------------------------------------------------------------------------

    def _finish(self, parent: ParentKey, outcome: LocalOutcome) -> None:
        """`parent` reached a local outcome: answer its waiters and drop the
        per-request bookkeeping (a long-running rank must not grow with traffic).
        The first outcome recorded wins (e.g. "failed" from byte verification over
        the protocol's "cancelled" for the round's decided failure). Outcomes
        themselves are remembered, boundedly, for late `wait` calls."""
        outcome = self._outcome.setdefault(parent, outcome, time.monotonic())
        for future in self._waiters.pop(parent, []):
            if not future.done():
                future.set_result(outcome)
        self._tokens.pop(parent, None)
        peer = self._pair_of.pop(parent, None)
        if peer is not None:
            pair = self._pairs.get(peer)
            if pair is not None and pair.left:
                self._drop_pair(peer)  # unloads once no parent with it is live
        self._forget(parent)

    async def wait(self, parent: ParentKey, timeout: float, absent: str | None = None) -> LocalOutcome | str:
        """Wait until `parent` reaches a local outcome (a `LocalOutcome`: completed,
        cancelled, ...; a str, so it compares with the plain strings), or "timeout".

        A parent this rank has never heard of and has no outcome for waits too
        (its admission or OPEN may still be on the way); `timeout` bounds it.
        A caller that knows no admission is on the way any more (the decision
        that ended it was applied here) passes `absent`: the answer for a
        parent this rank never held."""
        self._ensure_polling()
        state = self.side.live_state(parent)
        if absent is not None and state is None and parent not in self._outcome:
            return absent
        if parent in self._outcome and (
            state is None or state in (ParentState.RELEASED, ParentState.QUARANTINED, ParentState.DECODE_READY)
        ):
            return self._outcome[parent]
        future: asyncio.Future[LocalOutcome] = asyncio.get_running_loop().create_future()
        self._waiters[parent].append(future)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            waiting = self._waiters.get(parent, [])
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._waiters.pop(parent, None)
            return "timeout"

    async def returned(self, parent: ParentKey, timeout: float) -> bool:
        """Wait until this rank holds none of `parent`'s blocks any more: True
        once they are back in the pool (released, or reclaimed from
        quarantine with a proof of quiescence), False if `timeout` passed
        first (e.g. they are quarantined). An engine reuses its blocks only
        after this answered True on every rank that held them. A parent this
        rank does not hold answers True at once: ask after its outcome."""
        if not self.pool.holds(parent):
            return True
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._returns.setdefault(parent, []).append(future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            waiting = self._returns.get(parent, [])
            if future in waiting:
                waiting.remove(future)
            if not waiting:
                self._returns.pop(parent, None)
            return False

    async def stats(self) -> dict[str, Any]:
        self.pool.check_invariants()  # S4: raises if a block is in two states
        counts = self.pool.counts()
        states = collections.Counter(s.value for s in self.side.parents().values())
        return {
            "role": self.role.value,
            "rank": self.config.rank,
            "epoch": self.our.epoch,
            "agent": self.transport.name,
            "free": counts.free,
            "leased": counts.leased,
            "quarantined": counts.quarantined,
            "reclaimed": self.counters.get("reclaimed_blocks", 0),
            "admission_stopped": self.side.admission_stopped(),
            "pool": self.config.pool_blocks,
            "parents": dict(states),
            "in_flight_chunks": self._chunks_in_flight(),
            "posted_chunks": self.transport.posted_chunks,
            "posted_bytes": self.transport.posted_bytes,
            "leaked_handles": len(self.transport.leaked),
            "unproven_chunks": len(self.transport.unproven),
            # Per-request bookkeeping of requests still in progress: empty when idle.
            "tracking": len(self._tokens) + len(self._waiters) + len(self._returns) + self._tracking(),
            "counters": dict(self.counters),
            "violations": list(self.violations),
            "negotiated": negotiation_summary(self._negotiation),
            "pairs": {i: negotiation_summary(p.negotiation) for i, p in self._pairs.items()},
            "conservative": self._conservative(),
            "staging": self._staging_stats(),
            "quarantine": self._quarantine_detail(),
            "memory": {
                "resident_bytes": resident_bytes(),
                "outcomes": self._outcome.stats(),
                **self._remembered(),
            },
        }

    def _remembered(self) -> dict[str, Any]:
        """Role-specific bounded memories (`RecentMemory.stats()`), for `stats()`."""
        return {}

    def _quarantine_detail(self, limit: int = 8) -> list[dict[str, Any]]:
        """The quarantined parents held here (the first `limit`): the peer
        instance each pairs with and every edge's evidence, so a report
        says whose proof is still missing."""
        out: list[dict[str, Any]] = []
        for parent, state in self.side.parents().items():
            if state is not ParentState.QUARANTINED:
                continue
            if len(out) == limit:
                break
            edges = [
                [f"ctx{t.ctx.ns.rank}.e{t.ctx.epoch}", f"gen{t.gen.ns.rank}.e{t.gen.epoch}", e.state.value,
                 len(e.in_flight), e.terminal.value if e.terminal is not None else None]
                for t, e in self.side.edges(parent).items()
            ]
            out.append({"request_id": parent.request_id, "peer": self._pair_of.get(parent), "edges": edges})
        return out

    def _staging_stats(self) -> dict[str, Any]:
        return {"mode": self.config.data_mode, "arena_slots": self.arena.slots if self.arena is not None else 0}

    def _export_metrics(self, now: float) -> None:
        """Export the pool gauges and the growth of our counters through Ray
        (actors/_metrics.py); never raises into the protocol."""
        try:
            counts = self.pool.counts()
            staged = self._staging_stats().get("counters", {})
            counters = dict(self.counters)
            # Push: a CTX rank posts the WRITEs, a GEN rank receives them; the
            # other role's term is 0. Staged: CTX posts slots, GEN scatters them.
            counters["moved_bytes"] = self.transport.posted_bytes + self.counters["bytes_received"]
            counters["staged_chunks"] = staged.get("staged_chunks", 0) + staged.get("scattered", 0)
            counters["slots_quarantined"] = staged.get("slots_quarantined", 0)
            self.metrics.export(
                now,
                free=counts.free,
                leased=counts.leased,
                quarantined=counts.quarantined,
                pool=counts.total,
                admission_stopped=self.side.admission_stopped(),
                counters=counters,
            )
        except Exception as exc:
            metrics_failed(f"rank {self.ns}", exc)

    async def buffer_base(self) -> int:
        return self.buffer.base

    async def ping(self) -> int:
        """One Ray actor round trip (the control-plane yardstick)."""
        return self.config.rank

    # -- rounds (RoundParticipant exposes the member's methods as actor methods) ------

    async def round_vote(self, proposal: RoundProposal, epoch: int | None = None) -> RoundVote:
        if self.trace.every:
            ids = proposal_ids(proposal)
            self.trace.record_many(ids, "round_vote", "call", self._coordinator_actor)
        return await super().round_vote(proposal, epoch)

    async def round_apply(self, decision: RoundDecision, epoch: int | None = None) -> int:
        if self.trace.every:
            ids = decision_ids(decision)
            self.trace.record_many(ids, "round_apply", "call", self._coordinator_actor)
        self._ensure_polling()  # a decision may post chunks or start drains
        return await super().round_apply(decision, epoch)

    async def watch(self) -> None:
        """Never answers while this rank lives (returns at `shutdown`): its
        coordinator awaits it and learns of the rank's death at once (Ray
        fails the call), without waiting for its next round."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def shutdown(self) -> None:
        if self._stopped is not None:
            self._stopped.set()
        for task in list(self._tasks):
            task.cancel()
        if self._poll_task is not None:
            self._poll_task.cancel()


class CtxRankCore(RankCore):
    """A CTX (prefill) rank: it leases with a lease deadline and prefills on
    admission, checks every OPEN and plans its WRITE chunks, votes a parent
    prepared once every local edge is, posts the chunks of a decided parent and
    polls them to DONE or ERR (`CtxRankActor` is this class as a Ray actor).
    It runs the conservative path (a cancel waits for a decided transfer) when
    configured to, or when the agreed capabilities lack the active cancel
    protocol. It also hosts the benchmark baselines (`raw_write`,
    `copy_bench`, `transfer_timings`)."""

    role = Role.CTX
    peer_role = Role.GEN
    side: CtxRank
    admits_unpaired = True

    def _remembered(self) -> dict[str, Any]:
        return {"transfer_timings": self._xfer.stats()}

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
        super().__init__(config, epoch, tensors=tensors)  # last: it registers this rank
        if self.arena is not None:
            below = staged_below(self.buffer.device, config.staged_below)
            least = staged_min_descriptors(self.buffer.device, config.staged_min_descriptors)
            self._writer = StagedWriter(self, self.arena, config.staging_window, below, least)

    # -- the role's hooks ---------------------------------------------------------------

    def _ctx_and_gen(self) -> tuple[TopologySpec, TopologySpec]:
        return self.config.spec, self.config.peer_spec

    def _stage_notice(self, sender: str, notice: Any, now: float) -> None:
        if self._writer is None or not isinstance(notice, StageAck):
            self.counters["staged_misdirected"] += 1
            return
        self._writer.on_ack(sender, notice, now)

    def _stage_polling(self) -> bool:
        return (self._writer is not None and self._writer.busy()) or super()._stage_polling()

    def _staging_stats(self) -> dict[str, Any]:
        out = super()._staging_stats()
        if self._writer is not None:
            out.update(self._writer.stats())
        return out

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
        try:
            return self._receive_open(message, pair, now)
        except ProtocolError:
            if binding and not self.side.edges(parent):
                self._pair_of.pop(parent, None)
            raise

    def _receive_open(self, message: Open, pair: _Pair, now: float) -> list[Action]:
        gen = message.ticket.gen
        cols = block_columns(message.buffer)
        chunks = self._plan_chunks(message, pair, cols)
        geometry = self._geometry.get(message.buffer.agent_name)
        peer = None
        if geometry is not None:
            peer = PeerBuffer(
                message.buffer.agent_name, geometry.base, geometry.block_bytes, geometry.num_blocks,
                block_stride=geometry.region_table()[0][1],
            )
        actions = self.side.receive_open(
            message,
            now,
            num_chunks=len(chunks),
            expected_agent=agent_name(self.config.deployment, gen.ns, gen.epoch),
            block_bytes=pair.shards.gen_block_bytes,
            peer=peer,
        )
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
        progressed = False
        for key, chunk in list(self._in_flight.items()):
            state = chunk.poll()
            if state is XferState.PROC or state is XferState.PENDING:
                continue
            progressed = True
            del self._in_flight[key]
            chunk.release()
            ticket, index = key
            timing = self._xfer.get(ticket.parent)
            if timing is not None and state is XferState.DONE:
                timing[1] = time.perf_counter()
                timing[2] += chunk.nbytes
            try:
                if state is XferState.DONE:
                    actions = self.side.chunk_done(ticket, index, chunk.nbytes, now)
                else:
                    actions = self.side.chunk_failed(ticket, index, now, chunk.descriptors)
            except ProtocolError as exc:
                self.counters[f"poll_{type(exc).__name__}"] += 1
                continue
            self._perform(actions)
        if self._writer is not None and self._writer.poll(now):
            progressed = True
        if progressed and any(p.left for p in self._pairs.values()):
            self._drop_left_pairs()  # a pair kept loaded for a WRITE may go now
        return progressed

    def _chunks_in_flight(self) -> int:
        return len(self._in_flight) + (self._writer.in_flight() if self._writer is not None else 0)

    def _writing_to(self, instance: str) -> bool:
        if any(ticket.gen.ns.instance_id == instance for ticket, _ in self._in_flight):
            return True
        return self._writer is not None and self._writer.writing_to(instance)

    def _forget(self, parent: ParentKey) -> None:
        for ticket in [t for t in self._chunks if t.parent == parent]:
            del self._chunks[ticket]
            self._peer_agent.pop(ticket, None)
            if self._writer is not None:
                self._writer.forget(ticket)

    def _tracking(self) -> int:
        return len(self._chunks) + len(self._peer_agent)

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

    def _plan_chunks(self, message: Open, pair: _Pair, cols: BlockColumns) -> list[ChunkPlan]:
        """The WRITE chunks of one edge: our lease's blocks paired, in order, with
        the OPEN's GEN block addresses. Whether those may be written at all is the
        protocol's check (`CtxRank.receive_open`, right after this); a plan for an
        OPEN it refuses is dropped. An edge the shard map does not have is
        refused here (`UnknownEdgeError`, typed)."""
        ticket = message.ticket
        if ticket.ctx != self.our or not self.pool.holds(ticket.parent):
            # The protocol refuses it with a precise error (stale, unknown).
            return [ChunkPlan((), np.zeros(0, np.int32), np.zeros(0, np.int32), 0)]
        # Block indices only: the addresses come from the GEN's registered
        # regions at post time (`_gen_geometry`), the OPEN's are checked against them.
        lease = self.pool.lease_of(ticket.parent)
        n = min(len(lease), len(cols.blocks))  # unequal: the protocol refuses the OPEN right after
        pairs = np.empty((n, 2), dtype=np.int64)
        pairs[:, 0] = lease.blocks[:n]
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

    # -- benchmark baselines (same agent, same buffers, same descriptors) -----------------

    async def raw_write(
        self,
        gen_rank: int,
        blocks: list[int],
        gen_blocks: list[int],
        chunk_bytes: int | None = None,
        prepared: bool | None = None,
    ) -> tuple[int, float]:
        """CTX: a raw NIXL WRITE of our `blocks` into GEN rank `gen_rank`'s
        `gen_blocks`, with exactly the regions a handoff would use, no protocol.
        Returns (bytes, seconds from first post to last DONE)."""
        entry = await self._directory().lookup.remote(self._default_peer, gen_rank)
        (endpoint, name, metadata, geometry), _ = entry
        self._learn_agent(name, metadata, geometry)
        edge = (self.config.rank, gen_rank)
        for b, g in zip(blocks, gen_blocks):  # in both pools (DataPlaneError)
            self.buffer.block_addr(b), geometry.block_addr(g)
        pairs = list(zip(blocks, gen_blocks))
        chunk_bytes = chunk_bytes or self.config.chunk_bytes
        pieces = self._edge_pieces(edge, chunk_bytes)
        chunks = plan_chunks(pieces, pairs, chunk_bytes, self.buffer.region_table(), geometry.region_table())
        use_prepared = self.config.prepared_descriptors if prepared is None else prepared
        lists = self.transport.prepare(name, pieces, geometry) if use_prepared else None
        window = 4  # the protocol's default chunk window
        start = time.perf_counter()
        posted: list[Chunk] = []
        pending = list(chunks)
        while pending or posted:
            while pending and len(posted) < window:
                work = pending.pop(0)
                posted.append(NixlTransport.post(self.transport, name, work, prepared=lists))
            for chunk in list(posted):
                if chunk.poll() in (XferState.DONE, XferState.ERR):
                    if chunk.state is XferState.ERR:
                        raise RuntimeError("raw NIXL WRITE failed")
                    chunk.release()
                    posted.remove(chunk)
            if posted:
                await asyncio.sleep(0)
        seconds = time.perf_counter() - start
        return sum(c.nbytes for c in chunks), seconds

    async def raw_contiguous(self, gen_rank: int, nbytes: int, offset: int, chunk_bytes: int | None = None) -> tuple[int, float]:
        """CTX: a raw NIXL WRITE of `nbytes` contiguous bytes of our region 0
        into GEN rank `gen_rank`'s region 0 at `offset`, in chunks of
        `chunk_bytes` (window 4), no protocol: the link's ceiling for the
        same bytes a handoff moves in pieces. Returns (bytes, seconds)."""
        entry = await self._directory().lookup.remote(self._default_peer, gen_rank)
        (endpoint, name, metadata, geometry), _ = entry
        self._learn_agent(name, metadata, geometry)
        chunk_bytes = chunk_bytes or self.config.chunk_bytes
        ours, theirs = self.buffer.region_table()[0], geometry.region_table()[0]
        if nbytes > self.buffer.strides[0] * self.buffer.num_blocks or offset + nbytes > theirs[1] * geometry.num_blocks:
            raise DataPlaneError(f"{nbytes} B at {offset} do not fit both pools")
        work = [
            [(ours[0] + o, theirs[0] + offset + o, min(chunk_bytes, nbytes - o))]
            for o in range(0, nbytes, chunk_bytes)
        ]
        start = time.perf_counter()
        posted: list[Chunk] = []
        while work or posted:
            while work and len(posted) < 4:
                posted.append(NixlTransport.post(self.transport, name, work.pop(0)))
            for chunk in list(posted):
                if chunk.poll() in (XferState.DONE, XferState.ERR):
                    if chunk.state is XferState.ERR:
                        raise RuntimeError("raw NIXL WRITE failed")
                    chunk.release()
                    posted.remove(chunk)
            if posted:
                await asyncio.sleep(0)
        return nbytes, time.perf_counter() - start

    async def transfer_timings(self) -> list[tuple[str, float, int]]:
        """CTX: (request id, seconds from first post to last DONE, bytes) of recent parents."""
        return [(p.request_id, t[1] - t[0], int(t[2])) for p, t in self._xfer.items() if t[1] > 0]

    async def copy_bench(self, nbytes: int, repeats: int = 3) -> float:
        """Best seconds of a plain in-process copy of `nbytes` (the physical ceiling)."""
        n = min(nbytes, self.buffer.tensor.numel() // 2)  # within region 0
        src, dst = self.buffer.tensor[:n], self.buffer.tensor[n : 2 * n]
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            if self.buffer.tensor.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best * (nbytes / n)


class GenRankCore(RankCore):
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
        # Fault injection like `_held` (set through Ray's __ray_call__): installs
        # of these request ids wait here (`_open`).
        self._defer_open: dict[str, list[ParentKey]] = {}
        # Admitted parents whose blocks go back once decode-ready and verified.
        self._release_when_ready: set[ParentKey] = set()
        # Bytes verified per parent, until it is released (`free` answers them).
        self._verified: dict[ParentKey, int] = {}
        self._reader: StagedReader | None = None
        super().__init__(config, epoch, tensors=tensors)  # last: it registers this rank
        if self.arena is not None:
            self._reader = StagedReader(self, self.arena, config.staging_window)

    def _stage_notice(self, sender: str, notice: Any, now: float) -> None:
        if self._reader is None or not isinstance(notice, StageWrite):
            self.counters["staged_misdirected"] += 1
            return
        self._reader.on_write(sender, notice, now)

    def _stage_polling(self) -> bool:
        # A WRITE may land while a parent is installed, cancelling or
        # quarantined: the target's worker progresses meanwhile.
        return (
            super()._stage_polling()
            or (self._reader is not None and self._reader.pending() > 0)
            or self.side.any_live(_TARGET_STATES)
        )

    def _poll_chunks(self, now: float) -> bool:
        # GPU scatters that ran are ACKed here (the writer's credits).
        return self._reader is not None and self._reader.poll()

    def _chunks_in_flight(self) -> int:
        return self._reader.pending() if self._reader is not None else 0

    def _staging_stats(self) -> dict[str, Any]:
        out = super()._staging_stats()
        if self._reader is not None:
            out.update(self._reader.stats())
        return out

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

    def _perform_role(self, action: Action, now: float) -> list[Any]:
        match action:
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

    def _later(self, fn: Any, *args: Any) -> None:
        if _loop_running():
            asyncio.get_running_loop().call_soon(fn, *args)
        else:
            fn(*args)

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
        if self._reader is not None:
            self._reader.forget(parent)

    def _tracking(self) -> int:
        return len(self._release_when_ready) + len(self._verified)

    # -- verification (S2) --------------------------------------------------------------

    def _verify(self, parent: ParentKey) -> bool:
        lease = self.pool.lease_of(parent)
        expected = self._pattern(parent, self.config.rank, len(lease)).to(self.buffer.tensor.device)
        got = self.buffer.read_blocks(lease.block_list())
        for j, ref in enumerate(lease):
            if not torch.equal(got[j], expected[j]):
                self.violations.append(f"S2: {parent} block {ref.block} holds foreign bytes")
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

    def _describe(self, lease: BlockRefs, pair: _Pair) -> list[BlockDescriptor] | bytes:
        """An OPEN's block list for `lease`: packed (arrays, no per-block
        object) where `pair` negotiated it, else one descriptor per block."""
        addrs = self.buffer.block_addrs(lease.blocks)
        outcome = pair.negotiation
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
        if self.side.live_state(parent) is not ParentState.ADMITTED:
            return  # cancelled (and released) meanwhile: nothing to open
        if self._defer_open:
            deferred = self._defer_open.get(parent.request_id)
            if deferred is not None:
                deferred.append(parent)
                return
        pair = self._pairs.get(self._pair_of.get(parent, self._default_peer))
        if pair is None:  # its CTX instance left: the parent cannot proceed here
            self.counters["open_no_pair"] += 1
            self.member.record_failure(parent)
            self._nudge()
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


#: GEN parent states in which a CTX WRITE may be in flight toward this rank.
_TARGET_STATES = (ParentState.INSTALLED, ParentState.CANCELLING, ParentState.QUARANTINED)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _remote_methods() -> tuple[str, ...]:
    names: set[str] = set()
    for cls in (CtxRankCore, GenRankCore):
        for name, _member in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if not name.startswith("_"):
                names.add(name)
    return tuple(sorted(names))


#: The methods an `EndpointHost` forwards to its endpoint (what peers,
#: coordinators, the directory and clients call on a rank's actor handle).
ENDPOINT_METHODS = _remote_methods()


#: The Ray concurrency group an endpoint's methods run in: its own event loop
#: (its own thread), whatever the host actor does on its default loop.
ENDPOINT_GROUP = "kvhandoff"
#: At most this many endpoint calls run at once (Ray's default for an async actor).
ENDPOINT_CONCURRENCY = 1000


class EndpointHost:
    """Mixin for a Ray actor class that hosts a rank endpoint in ``self.kvhandoff``.

    The host constructs the endpoint in its ``__init__`` (which registers it
    with the deployment's directory, naming this actor as its handle) and
    keeps it for the actor's lifetime. Every name in `ENDPOINT_METHODS` is an
    async method of the host that forwards to the endpoint, in the Ray
    concurrency group `ENDPOINT_GROUP`: the endpoint lives on that group's
    event loop. The host must still never block its own default loop: run
    a forward pass or an engine step on a thread (Ray stops dispatching to
    every group of an async actor once a call queues behind a blocked loop
    that a call just returned from; docs/design.md). Make the class an
    actor with `endpoint_actor` (or declare the group in ``ray.remote``'s
    ``concurrency_groups`` yourself)."""

    kvhandoff: RankCore


def _forwarder(name: str) -> Any:
    async def forward(self: EndpointHost, *args: Any, **kwargs: Any) -> Any:
        endpoint = self.kvhandoff
        endpoint._home = asyncio.get_running_loop()  # where its state lives (the harness needs it)
        return await getattr(endpoint, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Forwarded to the hosted endpoint's `{name}`."
    return ray.method(concurrency_group=ENDPOINT_GROUP)(forward)


for _name in ENDPOINT_METHODS:
    setattr(EndpointHost, _name, _forwarder(_name))


def endpoint_actor(cls: Any = None, /, **options: Any) -> Any:
    """`ray.remote` for a class that mixes in `EndpointHost`: the same
    options, plus the endpoint's concurrency group. Use as ``@endpoint_actor``
    or ``@endpoint_actor(num_gpus=1)``."""

    def make(klass: Any) -> Any:
        if not issubclass(klass, EndpointHost):
            raise TypeError(f"{klass.__name__} does not mix in EndpointHost")
        groups = {**options.get("concurrency_groups", {}), ENDPOINT_GROUP: ENDPOINT_CONCURRENCY}
        return ray.remote(**{**options, "concurrency_groups": groups})(klass)

    return make(cls) if cls is not None else make


def on_endpoint_loop(host: Any, fn: Any, *args: Any) -> Any:
    """Run ``fn(endpoint, *args)`` on the loop the hosted endpoint lives on
    (for code that reaches an endpoint's internals through Ray's
    ``__ray_call__``, which runs on the host's default loop: the test
    harness). Waits for the answer."""
    endpoint = getattr(host, "kvhandoff", host)
    home = getattr(endpoint, "_home", None)
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if home is None or home is here or not home.is_running():
        return fn(endpoint, *args)

    async def call() -> Any:
        return fn(endpoint, *args)

    return asyncio.run_coroutine_threadsafe(call(), home).result()


class _CtxRankHost(EndpointHost):
    """kvhandoff's own CTX rank actor: a host of a `CtxRankCore` over memory
    it allocates (the synthetic path)."""

    def __init__(self, config: RankConfig, epoch: int) -> None:
        self.kvhandoff = CtxRankCore(config, epoch)


class _GenRankHost(EndpointHost):
    """kvhandoff's own GEN rank actor: a host of a `GenRankCore`."""

    def __init__(self, config: RankConfig, epoch: int) -> None:
        self.kvhandoff = GenRankCore(config, epoch)


CtxRankActor = endpoint_actor(num_cpus=0)(_CtxRankHost)
GenRankActor = endpoint_actor(num_cpus=0)(_GenRankHost)
_ACTOR_CLASSES = {Role.CTX: CtxRankActor, Role.GEN: GenRankActor}


def rank_actor_class(role: Role) -> Any:
    """The Ray actor class of a rank of `role`."""
    return _ACTOR_CLASSES[role]


class _RankActor:
    """`RankActor.options(**options).remote(config, epoch)`: a rank actor of
    the class `config.spec.role` names, created like any Ray actor class."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self._options = dict(options or {})

    def options(self, **options: Any) -> _RankActor:
        return _RankActor({**self._options, **options})

    def remote(self, config: RankConfig, epoch: int) -> Any:
        return rank_actor_class(config.spec.role).options(**self._options).remote(config, epoch)


RankActor = _RankActor()

