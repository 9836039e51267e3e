"""The state every rank holds, whatever its role, and the role's hooks.

`_RankState` is the base of `RankCore`'s concerns (actors/rank/_peers.py,
_control.py, _poll.py: mixins that read and change this state) and of
nothing else; `CtxRankCore` and `GenRankCore` fill in its hooks.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import torch

from kvhandoff.actors._channel import CallChannel, CallServer, rank_handlers
from kvhandoff.actors._dataplane import BufferGeometry, DataPlaneError, KVMemory, NixlTransport
from kvhandoff.actors._faults import FaultyTransport, RankFaults
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.actors._member import RoundMember, VoteNews
from kvhandoff.actors._metrics import RankMetrics
from kvhandoff.actors._names import agent_name
from kvhandoff.actors._staged import StagingArena
from kvhandoff.actors._stager import DATA_MODES, StagedReader, StagedWriter, staging_slot_bytes
from kvhandoff.actors._stream import FrameStreams
from kvhandoff.actors._trace import TraceRecorder, rank_actor_name
from kvhandoff.actors.rank._config import FRAME_CARRIERS, RankConfig, _loop_running, _Pair
from kvhandoff.protocol import (
    DEFAULT_TRANSFER_TIMEOUT,
    Action,
    AdmissionRequest,
    BlockPool,
    Capability,
    CtxRank,
    Endpoint,
    GenRank,
    LocalOutcome,
    Message,
    NegotiationOutcome,
    ParentKey,
    RankNamespace,
    RecentMemory,
    Role,
    RoundDecision,
    RoundProposal,
    descriptor_frame,
    local_descriptor,
)
from kvhandoff.topology import TopologySpec, block_bytes, heads_per_rank, topology_digest


def _node_address() -> str:
    """This node's address as Ray knows it (a rank's frame server listens there)."""
    import ray

    return str(ray.util.get_node_ip_address())

class _RankState:
    """What a `RankCore` holds (built here: `RankCore(config, epoch)`) and the
    role's hooks its concerns call. Each concern is a mixin over this class;
    for a type checker, what one concern calls on another is declared at the
    end (at run time `RankCore` has it from the mixin that defines it)."""

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
        plan = config.fault_plan
        if plan is not None and plan.chunk_faults:  # the poster's chunks: CTX WRITEs, GEN READs
            self.transport: NixlTransport = FaultyTransport(name, self.buffer, plan)
        else:
            self.transport = NixlTransport(name, self.buffer)
        #: Fault injection, injected at construction (actors/_faults.py): the
        #: live fault state a harness drives; None without a `FaultPlan` (a
        #: harness may install one later on a live rank).
        self.faults: RankFaults | None = RankFaults() if plan is not None else None
        if config.frames not in FRAME_CARRIERS:
            raise ValueError(f"frames must be one of {FRAME_CARRIERS}, got {config.frames!r}")
        if config.data_mode not in DATA_MODES:
            raise ValueError(f"data_mode must be one of {DATA_MODES}, got {config.data_mode!r}")
        if config.staging_window <= 0:
            raise ValueError(f"staging_window must be positive, got {config.staging_window}")
        if config.staging_slot_bytes < 0:
            raise ValueError(f"staging_slot_bytes must be 0 (the device's default) or positive, got {config.staging_slot_bytes}")
        # The staging arena: `staging_window` slots per peer rank, one staged chunk each.
        self.arena: StagingArena | None = None
        #: The role's staged end over it (`StagedWriter` on CTX, `StagedReader`
        #: on GEN), which the role builds once this rank is registered, and
        #: its handler of each kind of staging notice it takes.
        self._staged: StagedWriter | StagedReader | None = None
        self._stage_takers: dict[type, Callable[[str, Any, float], None]] = {}
        if config.data_mode != "direct":
            slot_bytes = -(-staging_slot_bytes(config, str(self.buffer.device)) // 8) * 8
            self.arena = StagingArena(config.staging_window * peer.tp, slot_bytes, self.buffer.device)
            self.transport.register_arena(self.arena.tensor)
        # Every NIXL notification is drained by one channel: control frames
        # (frames="nixl") and staging notices (an arena) are told apart there.
        self._channel = NixlNotifChannel(self.transport)
        # GPU memory: poll without sleeping during a burst of progress.
        self._hot = self.buffer.mem_kind == "VRAM"
        # When this rank last posted a chunk (its loop's clock): a small
        # chunk ends within tens of µs, so the loop only yields for
        # `HOT_AFTER_POST_S` after a post, then backs off (`_poll_loop`).
        self._posted_at = float("-inf")
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
        self._report_due = False
        self._lazy_report_due = False
        # When this rank last pushed a report (its loop's clock; `report_gap_s`).
        self._last_report_at = float("-inf")
        # Frames waiting to go, per peer endpoint (`_flush`): [handle, frames,
        # urgent]. An urgent frame goes when this event-loop turn ends; a
        # lazy one (READY, RECEIPT) with the next urgent frame to its peer,
        # or `lazy_flush_s` later at the latest.
        self._outbox: dict[Endpoint, list[Any]] = {}
        self._flush_due = False
        self._lazy_flush_due = False
        # Admitted parents' token counts (GEN: for its OPENs), until their outcome.
        self._tokens: dict[ParentKey, int] = {}
        # A rank alone in its instance: parents it completed itself
        # (`_completing`: CTX released, GEN decode-ready); the completion
        # decision that follows is theirs already, until a decision settles them.
        self._completed_alone: set[ParentKey] = set()
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
        #: frames="stream": this rank's server and its connection per peer
        #: endpoint (actors/_stream.py); None for the other carriers.
        self._streams: FrameStreams | None = None
        if config.frames == "stream":
            # `own` looks `_own` up at each call (a harness may wrap it).
            self._streams = FrameStreams(
                _node_address, self._stream_frame, self._frame_call, lambda coro: self._own(coro), self.counters
            )
        #: frames="stream" too: the server its coordinator's round calls come
        #: over, and the channel it pushes its reports on (actors/_channel.py).
        self._calls: CallServer | None = None
        self._coordinator_channel: CallChannel | None = None
        if config.frames == "stream":
            self._calls = CallServer(_node_address, rank_handlers(self), lambda ch: self._take_channel(ch), self.counters)
        # `close_admission`: the instance drains; this rank admits nothing on
        # its own any more (CTX: at an OPEN; GEN: a receive at the rank).
        self._admission_closed = False
        # Exported through Ray from the poll loop's expire tick (`_export_metrics`).
        self.metrics = RankMetrics(config.deployment, spec.instance_id, spec.role.value, config.rank)
        self.violations: list[str] = []
        # Negotiation: nothing agreed until connect() (or a frame) gathered every descriptor.
        descriptor = config.descriptor or local_descriptor()
        if config.descriptor is None and (not config.pull or config.data_mode == "staged"):
            descriptor = msgspec.structs.replace(descriptor, capabilities=descriptor.capabilities & ~Capability.PULL)
        self._descriptor = descriptor_frame(descriptor)
        # A CTX rank that may lend (pull) seals its lends with a key of this
        # incarnation, which its peers read from its directory entry.
        pulls = bool(descriptor.capabilities & Capability.PULL)
        self._lend_key = os.urandom(16) if pulls and self.role is Role.CTX else b""
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

    def _completing(self, parent: ParentKey, now: float) -> list[Any]:
        """`parent` settled here without a cancel (GEN: its bytes verified);
        its completion report goes to the rounds. The only rank of its
        instance is the whole intersection a completion round would take, so
        it applies that decision now: a CTX rank releases its blocks (every
        edge terminal COMPLETED: no WRITE of ours reads them any more, S1), a
        GEN rank makes the parent decode-ready. Safe at any cancel: a cancel
        or failure the leader decides later finds the parent released or
        decode-ready, as one it completed in a round; the leader's decision
        still answers the client and settles `_completed_alone`."""
        if self.config.spec.tp != 1:
            return []
        self.counters["completed_alone"] += 1
        self._completed_alone.add(parent)
        if self.role is Role.CTX and _loop_running():
            # Nobody waits for a CTX release: it runs once this turn's
            # frames (the TERMINAL that settled it) are on their way.
            asyncio.get_running_loop().call_soon(self._release_alone, parent)
            return []
        return self._perform(self.side.completed(parent, now))

    def _release_alone(self, parent: ParentKey) -> None:
        """A CTX rank's completion alone (`_completing`), after the turn that
        settled it. A parent no longer live was released meanwhile (a decided
        cancel releases a settled parent itself); one still live is SETTLED
        (nothing else follows that state but a release)."""
        if self.side.is_live(parent):
            self._perform(self.side.completed(parent, time.monotonic()))

    def _completion_can_wait(self, parent: ParentKey) -> bool:
        """Whether nothing waits at once for this rank's report that `parent`
        completed (a CTX rank's completions: no answer depends on them), so
        it may wait `lazy_flush_s` for other news to ride with."""
        return self.role is Role.CTX

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

    if TYPE_CHECKING:
        # -- what one concern calls on another (`RankCore` has them from its mixins) ------

        # actors/rank/_peers.py
        def _register(self) -> None: ...
        @property
        def _negotiation(self) -> NegotiationOutcome: ...
        def _renegotiate(self, pair: _Pair) -> None: ...
        async def _await_agreement(self, pair: _Pair) -> None: ...
        def _pair_for(self, message: Message) -> _Pair: ...
        def _check_agreed(self, pair: _Pair, message: Message, version: int) -> None: ...
        def _encode(self, message: Message, answering: int | None = None) -> bytes | None: ...
        async def _peer(self, their: Endpoint) -> Any: ...
        def _drop_pair(self, instance: str) -> None: ...
        def _find_coordinator(self) -> bool: ...

        # actors/rank/_control.py
        def _nudge(self) -> None: ...
        def _own(self, awaitable: Any) -> None: ...
        def _vote(self, proposal: RoundProposal) -> VoteNews: ...
        def _apply(self, decision: RoundDecision) -> None: ...
        async def _receive_frame(self, frame: bytes, carrier: str) -> bool: ...
        async def _stream_frame(self, frame: bytes) -> bool: ...
        def _take_channel(self, channel: CallChannel) -> None: ...
        def _frame_call(self, handle: Any, frames: list[bytes]) -> None: ...
        def _replay_parked(self) -> None: ...
        def _perform(self, actions: list[Action]) -> list[Any]: ...
        def _send(self, to: Endpoint, frame: bytes | Message, request_id: str = "") -> Any: ...

        # actors/rank/_poll.py
        def _ensure_polling(self) -> None: ...
        def _finish(self, parent: ParentKey, outcome: LocalOutcome) -> None: ...
        def _export_metrics(self, now: float) -> None: ...
