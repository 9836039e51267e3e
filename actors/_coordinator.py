"""The `Coordinator` actor: agreement rounds, their watchdog and the fail policy.

One coordinator per topology (one instance: its TP ranks) drives the
sans-IO `RoundLeader` over the rank actors (docs/design.md "Agreement rounds";
docs/rounds.md). A rank actor takes part by composing a `RoundMember` and
exposing its methods ``round_identity``, ``round_join``, ``round_vote`` and
``round_apply`` as actor methods.

One round is two fan-out phases, each under its own watchdog
(``asyncio.timeout(round_timeout)``):

1. vote: the proposal goes to every rank (``round_vote``); the leader
   validates each vote (round, rank, endpoint epoch, deadline);
2. apply: the decision goes to every rank (``round_apply``), and only then
   are the clients' ``admit`` / ``cancel`` calls answered; the peer
   instance's ``admit_many`` and a ``release_when_ready`` submission's
   completion are answered at the decision (`_answer_early`).

Group commit: every pending admission (up to ``max_batch``), every pending
cancel and everything the ranks reported go into the next round, and the next
round starts as soon as the previous one ended, so the cost per request falls
as load grows; ``batch_window`` seconds of extra waiting can be added to
gather more. Ranks push their news (``report``, a `RankReport`, one way); a
round without admissions is decided from the latest report of every rank
without the vote fan-out, and a round the reports cannot decide anything in
is not run. While requests are in flight and nothing happens for a round
bound, a vote round probes every rank, so a dead rank that holds a share of
an intersection is found and restarted.

Pairing: the GEN instance's coordinator is constructed with the CTX
coordinator's actor name as ``peer``. ``submit`` is the client's one call per
handoff: its admission joins the next round, the peer admits the same batch
(``admit_many``) while the GEN ranks vote, and the round admits only what both
instances admitted (``RoundLeader.close(vetoed=...)``); what only the peer
admitted is cancelled there. The decision that ends the parent answers
``submit``. A ``cancel`` here is forwarded to the peer after any admission
asked of it (tasks start in creation order), so it can never overtake it.

Fail policy (a rank that misses a deadline, dies, answers with a stale epoch
or raises): the round ends with a `RoundTimedOut` whose decision the
surviving ranks apply (nothing admitted, every in-flight parent failed, so
their leases become UNKNOWN → quarantine, decided by their session logic);
admission stops (``admit`` raises `AdmissionStopped`); the rank actor is
killed (``ray.kill``), then the factory is told its epoch is retired (optional
``rank_factory.retired(rank, epoch)``: the deployment forwards it to the peer
instance's ranks), the rank is recreated by ``rank_factory`` with a NEW
endpoint epoch, joins at the leader's next round, and admission resumes. After
``max_restarts`` restarts, the topology is FAILED and every call raises
`TopologyFailed`.

Planned restarts (``request_restart``): a rank whose quarantine passed its
limit and that holds nothing else asks to be replaced; the same restart runs
(admission stopped meanwhile), outside the failure budget. The new incarnation
has a fresh pool; the directory confirms the old one dead before its peers
reclaim what it left quarantined on their side.

Concurrency inside this actor: one asyncio lock (``_round_lock``) serializes
rounds and the fail policy; client calls never take it (they only queue work
and await a future), and the coordinator never awaits a client. A decided
round sends its decision to every rank and leaves its *tail* (awaiting the
applies, then recording and answering, in round order) to run while the
next round proposes; at most one round's apply is still out when a round
opens, and a rank takes a proposal that overtook that apply in its turn
(`RoundMember`). A tail never takes the lock: a rank that failed to apply
makes the next round ask for votes, which finds it. It awaits
ranks only inside a watchdog, and ranks never await the coordinator (their
``report`` and ``nudge`` are fire-and-forget). The GEN coordinator awaits its
peer, the CTX coordinator (``admit_many``, bounded by twice the round
timeout), and the CTX coordinator never awaits the GEN one, so there is no
wait-for cycle.

The parts: this module holds the actor, its state, its start and its client
API; actors/_coordinator_rounds.py the round machinery (`RoundsMixin`),
actors/_coordinator_peers.py the pairing with the peer instance
(`PeersMixin`), actors/_coordinator_ranks.py the rank lifecycle and the fail
policy (`RanksMixin`), actors/_coordinator_errors.py the errors and
`TopologyState` (re-exported here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

import msgspec
import ray
from msgspec import Meta

from kvhandoff.actors import _coordinator_errors as _errors
from kvhandoff.actors._channel import RankLinks, carried_by, coordinator_handlers
from kvhandoff.actors._checks import check_admission
from kvhandoff.actors._coordinator_clients import ClientsMixin
from kvhandoff.actors._coordinator_errors import (
    AdmissionStopped,
    CoordinatorError,
    InstanceDraining,
    ParentInFlight,
    RoundTimeout,
    TopologyFailed,
    TopologyState,
)
from kvhandoff.actors._coordinator_peers import PeersMixin
from kvhandoff.actors._coordinator_ranks import RankFactory, RanksMixin, _kill
from kvhandoff.actors._coordinator_rounds import RoundsMixin, _Carried
from kvhandoff.actors._heap import freeze_startup_heap
from kvhandoff.actors._metrics import InstanceMetrics, resident_bytes
from kvhandoff.actors._submit import SubmitAnswer, SubmitRequest
from kvhandoff.actors._trace import TraceEvent, TraceRecorder, news_ids, with_events_of
from kvhandoff.protocol import (
    MAX_ROUND_ITEMS,
    AdmissionRequest,
    ParentKey,
    RankReport,
    RecentMemory,
    RoundDecision,
    RoundError,
    RoundLeader,
    StaleEpochError,
)

__all__ = ["Coordinator", "CoordinatorConfig", "CoordinatorCore", *_errors.__all__]  # the errors re-exported


#: The byte budget of the recent round decisions a coordinator keeps (`decision_log`).
_DECISION_LOG_BYTES = 2 << 20

#: How long the apply of a decision that only settles completions nobody
#: waits on may wait for the next vote round to ride with (`lazy_apply_s`).
LAZY_APPLY_S = 0.005


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A coordinator's settings, checked when built (`ValueError` naming the
    setting): a bad one fails in the caller, before any actor starts."""

    # -- rounds -----------------------------------------------------------------------
    #: Seconds each phase of a round may take.
    round_timeout: Annotated[float, Meta(gt=0)] = 2.0
    #: Extra seconds a round waits to gather a batch (0: it starts at once).
    batch_window: float = 0.0
    #: Admissions one round takes.
    max_batch: Annotated[int, Meta(ge=1, le=MAX_ROUND_ITEMS)] = 1024
    #: How long the apply of a decision that only settles completions nobody
    #: waits on may wait for the next vote round to ride with (0: every
    #: apply goes at once unless a vote round takes it); below `round_timeout`.
    lazy_apply_s: Annotated[float, Meta(ge=0)] = LAZY_APPLY_S
    # -- restarts ---------------------------------------------------------------------
    #: Rank restarts, topology-wide, before the instance fails.
    max_restarts: int = 3
    #: Bound on restarting one rank actor (the first start waits on progress
    #: instead, `_identities`), and on the back-off between tries.
    restart_timeout: float = 30.0
    #: Incarnations tried for one restart before the instance fails.
    restart_attempts: Annotated[int, Meta(ge=1)] = 3
    #: The first back-off between failed tries (seconds, doubling).
    restart_backoff: Annotated[float, Meta(ge=0)] = 0.1
    #: The first rank incarnation's epoch.
    first_epoch: int = 1
    # -- peers and admission ----------------------------------------------------------
    #: The peer instance's coordinator actor (one pair) ...
    peer: str | None = None
    #: ... or the fleet whose `<fleet>.coord.<instance>` actors are the peers.
    fleet: str | None = None
    #: Admissions are claimed at the peer coordinator (an engine's GEN).
    peer_claims: bool = False
    #: The directory of an engine whose failed workers are detached until
    #: re-attached, not restarted.
    reattach: str | None = None
    #: A one-rank instance's rank admits at the peer's OPEN, with no round.
    admits_at_open: bool = False
    #: A one-rank instance's rank admits at its own receive, with no round.
    admits_alone: bool = False
    #: Clients may submit over a channel (`submit_address`): frames go by stream.
    client_channels: bool = False

    def __post_init__(self) -> None:
        if not self.round_timeout > 0:
            raise ValueError(f"round_timeout must be positive, got {self.round_timeout!r}")
        if not 1 <= self.max_batch <= MAX_ROUND_ITEMS:
            raise ValueError(f"max_batch must be in [1, {MAX_ROUND_ITEMS}], got {self.max_batch!r}")
        if type(self.restart_attempts) is not int or self.restart_attempts < 1:
            raise ValueError(f"restart_attempts must be an int >= 1, got {self.restart_attempts!r}")
        if not self.restart_backoff >= 0:
            raise ValueError(f"restart_backoff must be >= 0, got {self.restart_backoff!r}")
        if not 0 <= self.lazy_apply_s < self.round_timeout:
            raise ValueError(f"lazy_apply_s must be in [0, round_timeout), got {self.lazy_apply_s!r}")



class CoordinatorCore(RoundsMixin, PeersMixin, RanksMixin, ClientsMixin):
    """The coordinator's implementation; `Coordinator` is this class as a Ray
    actor (``Coordinator.remote(...)``). Every public method is a coroutine.

    Parameters: ``topology`` (a name used in errors and stats); ``ranks`` (the
    rank actor handles, rank i at index i) and/or ``rank_factory`` (a
    picklable ``(rank, epoch) -> ActorHandle`` used to create the ranks when
    ``ranks`` is None, with ``tp`` ranks, and to restart them);
    ``topology_digest`` (checked by the followers if set); ``config`` (a
    `CoordinatorConfig`: rounds, restarts, peers, admission).
    """

    def __init__(
        self,
        topology: str,
        ranks: Sequence[Any] | None = None,
        *,
        rank_factory: RankFactory | None = None,
        tp: int | None = None,
        topology_digest: bytes | None = None,
        config: CoordinatorConfig | None = None,
    ) -> None:
        if ranks is None and (rank_factory is None or not tp):
            raise ValueError("give the rank handles, or a rank_factory and tp")
        cfg = config or CoordinatorConfig()
        self._lazy_apply_s = float(cfg.lazy_apply_s)
        self.topology = topology
        self._handles: list[Any] = list(ranks) if ranks is not None else []
        self._tp = len(self._handles) if ranks is not None else int(tp or 0)
        if cfg.admits_at_open and self._tp != 1:
            raise ValueError(f"admits_at_open is for an instance of one rank, got tp={self._tp}")
        if cfg.admits_alone and self._tp != 1:
            raise ValueError(f"admits_alone is for an instance of one rank, got tp={self._tp}")
        self._owns_ranks = ranks is None
        self._rank_factory = rank_factory
        self._round_timeout = float(cfg.round_timeout)
        self._max_restarts = cfg.max_restarts
        self._batch_window = cfg.batch_window
        self._max_batch = cfg.max_batch
        self._restart_timeout = cfg.restart_timeout
        self._restart_attempts = cfg.restart_attempts
        self._restart_backoff = float(cfg.restart_backoff)
        self._restart_failures = 0  # incarnations that failed to start (stats)
        self._digest = topology_digest
        self._peer_name = cfg.peer
        self._peer: Any = None
        # A fleet: the coordinator of peer instance I is the actor
        # `<fleet>.coord.<I>`; a submission names its peer instance ("": `peer`).
        self._fleet = cfg.fleet
        self._peers: dict[str, Any] = {}
        self._draining = False  # `drain()`: admit nothing new, ever again
        # Ranks we cannot restart (an engine's workers: `reattach` names the
        # deployment's directory): a failed one is detached until the engine
        # re-attaches a new incarnation (`replace_rank`); admission stays
        # stopped and no round runs meanwhile.
        self._reattach_directory = cfg.reattach
        self._detached: set[int] = set()
        self._reattached = 0
        self._stopped: asyncio.Event | None = None  # set by shutdown (`watch` returns)
        self._round_done = asyncio.Event()  # set after every round (drain waits on it)
        # Submitted parents -> their peer instance (for cancels): written at the
        # submission and again at each decision about the parent, so it is
        # kept while the parent lives and `RETAIN_S` after its last decision.
        self._peer_of: RecentMemory[ParentKey, str] = RecentMemory()
        # Cancels of parents we did not know yet (`cancel`): a one-rank GEN
        # rank's receive (`receive_alone`) admits with no call of ours, and
        # we learn of it from its report, which a cancel may overtake. Kept
        # `RETAIN_S`; a report that brings one in flight has it cancelled.
        self._cancelled_early: RecentMemory[ParentKey, bool] = RecentMemory()
        self._next_epoch = cfg.first_epoch
        self._epochs: list[int] = []
        self._leader: RoundLeader | None = None
        # Exported through Ray (actors/_metrics.py): rounds, restarts, admission.
        self._metrics = InstanceMetrics.for_actor(topology)
        self.state = TopologyState.STARTING
        self._failure_reason = ""
        # Pending client work, taken in arrival order by the next round.
        self._pending_admits: dict[ParentKey, tuple[AdmissionRequest, asyncio.Future[bool]]] = {}
        # Engine deployments: the peer (CTX) instance published the parent
        # already (`publish`); a submission claims it there (`claim_many`)
        # instead of admitting it. On the CTX side, the parents claimed once.
        # A CTX instance of one rank binds a published parent to the first
        # GEN instance whose OPEN reaches its rank (`binds_at_first_open`):
        # toward it a GEN instance of one rank admits alone, and its claim
        # only names the claimer (for cancels), off the handoff's path.
        self._peer_claims = cfg.peer_claims
        # Admission at the OPEN (docs/design.md "Admission at the OPEN").
        # CTX of one rank: that rank admits a parent at its first OPEN and
        # reports it (`admits_at_open`; this coordinator joins the rank
        # before it serves and closes its admission when it drains). GEN:
        # per peer instance, whether it admits at the OPEN (asked once per
        # peer incarnation, `_learn_direct`); a submitted handoff paired
        # with one asks no peer admission: the OPEN is it, and a refusal
        # comes back as a REJECT (NOT_STARTED) that fails the handoff. An
        # engine's GEN asks instead whether the peer binds at the first OPEN.
        self._admits_at_open = cfg.admits_at_open
        # A GEN instance of one rank hands a submission paired with such a
        # peer to its rank (`_admit_alone`): no admission round at all. Its
        # calls still out, per parent (a cancel of it waits for its answer).
        self._admits_alone = cfg.admits_alone
        self._alone_calls: dict[ParentKey, asyncio.Future[None]] = {}
        self._direct: dict[str, bool] = {}
        self._asking_direct: set[str] = set()
        self._claimed: set[ParentKey] = set()
        # Submitted handoffs (`submit`): their outcome, resolved by the decision
        # that ends them; and the admissions the peer instance must admit too.
        self._submitted: dict[ParentKey, asyncio.Future[str]] = {}
        # Answered at the decision, before the ranks applied it (one hop
        # less on the handoff's path): admissions the peer instance asked for
        # (`admit_many`), and submissions whose GEN ranks return the blocks
        # themselves once verified (`release_when_ready`) when they complete.
        self._admit_at_decision: set[ParentKey] = set()
        self._complete_at_decision: set[ParentKey] = set()
        # Submissions into an engine's own blocks: their caller waits until
        # the GEN ranks gave the blocks back (the engine may reuse them only
        # then), which they do when they apply the completion. Its apply is
        # never delayed to ride with a later round (`_may_wait`).
        self._returns_awaited: set[ParentKey] = set()
        self._owned: set[asyncio.Task[Any]] = set()
        # Submitted parents the peer failed to admit (it raised): "failed", not "rejected".
        self._peer_failed: set[ParentKey] = set()
        # A nudge (news not pushed as a report) makes the next round ask for votes.
        self._want_votes = False
        self._pending_cancels: dict[ParentKey, list[asyncio.Future[str | None]]] = {}
        self._pending_failures: set[ParentKey] = set()
        # Asyncio primitives bind to the running loop on first use (3.10+).
        self._start_lock = asyncio.Lock()
        self._round_lock = asyncio.Lock()
        # Tails of decided rounds whose apply is still out (`_round_tail`), oldest first.
        self._tails: list[asyncio.Task[None]] = []
        # A decided round's apply kept to ride with the next round's votes
        # (`_carry_apply`); sent alone by `_flush_carry` if no vote comes.
        self._carried: _Carried | None = None
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        # Stats.
        self._rounds = 0
        self._rounds_timed_out = 0
        self._restarts = 0
        self._reclaim_restarts = 0
        self._reclaimed_by_restart = 0
        self._counts: collections.Counter[str] = collections.Counter()
        self._rejected_votes: collections.Counter[str] = collections.Counter()
        self._round_seconds: collections.deque[float] = collections.deque(maxlen=1024)
        self._rank_errors: collections.deque[str] = collections.deque(maxlen=32)
        self._decisions_logged = 0
        self._last_decided = 0  # the last round decided (an admission alone waits for its apply)
        # Recent decisions (debugging, tests) and decided outcomes (late
        # `outcome` calls), each bounded by age and bytes (`RecentMemory`).
        self._decision_log: RecentMemory[int, RoundDecision] = RecentMemory(max_bytes=_DECISION_LOG_BYTES)
        self._outcomes: RecentMemory[ParentKey, str] = RecentMemory()
        self._timeouts: collections.deque[RoundTimeout] = collections.deque(maxlen=8)
        self._start_status: dict[int, str] = {}  # rank -> how its start went (start_status)
        # Ray calls this coordinator made (per kind) and reports it took: the
        # bench divides them by the handoffs to print calls per handoff.
        self.calls: collections.Counter[str] = collections.Counter()
        self._links = RankLinks(coordinator_handlers(self), self.calls, lambda coro: self._own(coro))
        self._client_channels, self._clients = cfg.client_channels, None  # actors/_coordinator_clients.py
        # Hop traces of sampled requests (off until `set_trace`; actors/_trace.py).
        self.trace = TraceRecorder(f"coord@{topology}")
        self._trace_peer = ""

    # -- lifecycle --------------------------------------------------------------

    @property
    def state(self) -> TopologyState:
        return self._state

    @state.setter
    def state(self, state: TopologyState) -> None:
        # Every change of state is an admission change for the metrics.
        self._state = state
        self._metrics.admission(state in (TopologyState.RECOVERING, TopologyState.FAILED))

    def _raise_if_unusable(self) -> None:
        if self.state in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
            raise TopologyFailed(self.topology, self._failure_reason)

    async def _ensure_started(self) -> None:
        self._raise_if_unusable()
        if self._leader is not None:
            return
        async with self._start_lock:
            self._raise_if_unusable()  # an earlier caller's start may have failed
            if self._leader is not None:
                return
            if self._owns_ranks and not self._handles:
                assert self._rank_factory is not None
                for rank in range(self._tp):
                    self._handles.append(self._rank_factory(rank, self._take_epoch()))
                    self._epochs.append(self._next_epoch - 1)
            identities = await self._identities()
            for index, (rank, _) in enumerate(identities):
                if rank != index:
                    self._enter_failed(f"handle {index} reports rank {rank}")
                    raise TopologyFailed(self.topology, self._failure_reason)
            self._epochs = [epoch for _, epoch in identities]
            self._next_epoch = max(self._next_epoch, max(self._epochs) + 1)
            self._leader = RoundLeader(
                self._tp,
                epochs=dict(enumerate(self._epochs)),
                topology_digest=self._digest,
            )
            if self._admits_at_open or self._admits_alone:
                # Our rank admits on its own: not before we took it in (a
                # restarted one is joined by `_restart`).
                await asyncio.gather(
                    *(h.round_join.remote(self._leader.next_round, e) for h, e in zip(self._handles, self._epochs))
                )
            self.state = TopologyState.RUNNING
            # Owned: kept in self._loop_task and cancelled by shutdown().
            self._loop_task = asyncio.get_running_loop().create_task(self._round_loop())
            for rank in range(self._tp):
                self._watch_rank(rank)

    def _take_epoch(self) -> int:
        epoch = self._next_epoch
        self._next_epoch += 1
        return epoch

    async def shutdown(self, kill_owned_ranks: bool = True) -> None:
        """Stop the round loop, fail pending calls, kill the ranks we created."""
        if self._stopped is not None:
            self._stopped.set()
        if self.state is not TopologyState.FAILED:
            self._failure_reason = "shut down"
            self.state = TopologyState.SHUT_DOWN
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._flush_carry()  # its tail ends on the answers, not on the watchdog
        self._fail_pending(TopologyFailed(self.topology, self._failure_reason))
        for owned in list(self._owned):
            owned.cancel()
        self._links.close()
        self._close_clients()
        if kill_owned_ranks and self._owns_ranks:
            for handle in self._handles:
                _kill(handle)

    # -- client API ---------------------------------------------------------------

    async def admit(self, parent: ParentKey, num_tokens: int, blocks: Sequence[int] = ()) -> bool:
        """Admit ``parent``: True when every rank agreed (leased its blocks),
        False when a rank refused, the parent was cancelled in the same round
        (cancel wins) or the round timed out. Raises `AdmissionStopped` while
        a rank restarts, `TopologyFailed` once the topology failed, and
        `RoundError` for a parent already pending or in flight."""
        await self._ensure_started()
        future = self._queue_admission(self._checked(AdmissionRequest(parent, num_tokens), blocks))
        self._wakeup.set()
        return await future

    async def admit_many(self, requests: Sequence[tuple[ParentKey, int]], peer_instance: str = "") -> list[bool]:
        """`admit` for many ``(parent, num_tokens)`` in one call (one Ray hop);
        they join the same round batch. All or nothing on bad input.
        ``peer_instance``: the instance (of the other role) they pair with
        ("": the configured peer); raises `InstanceDraining` while draining."""
        if self.trace.every:
            source = f"coord@{peer_instance}" if peer_instance else self._trace_peer
            ids = [p.request_id for p, _ in requests]
            self.trace.record_many(ids, "admit_many", "call", source)
        await self._ensure_started()
        self._raise_if_draining()
        parents = [parent for parent, _ in requests]
        if len(set(parents)) != len(parents):
            raise RoundError("admit_many names a parent twice")
        for parent in parents:
            self._check_admissible(parent)
        futures = [
            self._queue_admission(self._checked(AdmissionRequest(parent, tokens, peer_instance=peer_instance)))
            for parent, tokens in requests
        ]
        self._admit_at_decision.update(parents)
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def claim_many(self, parents: Sequence[ParentKey], peer_instance: str = "") -> list[bool]:
        """CTX of an engine deployment: the GEN coordinator claims parents
        this instance published (admitted through `admit` with the engine's
        block ids, the KV resident on every rank). True for a parent that is
        admitted here, still in flight, not being cancelled and not claimed
        before (a ticket is claimed once: a second claim, a claim after its
        lease ran out or after a cancel, or of a parent never published is
        False). In a fleet, ``peer_instance`` names the claiming GEN
        instance: a cancel of a claimed parent here is forwarded to it, so
        one call to this coordinator ends the ticket in both instances.
        Raises `AdmissionStopped` while a rank restarts."""
        await self._ensure_started()
        if self.state is TopologyState.RECOVERING:
            raise AdmissionStopped(self.topology, self._failure_reason or "a rank is restarting")
        assert self._leader is not None
        in_flight = self._leader.in_flight
        self._claimed &= in_flight  # ended parents need no memory: they cannot be claimed
        answers = []
        now = time.monotonic()
        for parent in parents:
            ok = parent in in_flight and parent not in self._claimed and parent not in self._pending_cancels
            if ok:
                self._claimed.add(parent)
                if peer_instance:
                    self._peer_of.remember(parent, peer_instance, now)
            answers.append(ok)
        self.calls["claims"] += len(parents)
        return answers

    def _raise_if_draining(self) -> None:
        if self._draining:
            raise InstanceDraining(self.topology, "draining: it leaves once its handoffs end")

    def _check_admissible(self, parent: ParentKey) -> None:
        if self.state is TopologyState.RECOVERING:
            raise AdmissionStopped(self.topology, self._failure_reason or "a rank is restarting")
        assert self._leader is not None
        proposal = self._leader.proposal
        if (
            parent in self._pending_admits
            or parent in self._leader.in_flight
            or parent in self._submitted  # decided, its answer not sent yet
            or (proposal is not None and any(a.parent == parent for a in proposal.admissions))
        ):
            raise ParentInFlight(f"parent {parent!r} is already pending or in flight")

    def _checked(self, request: AdmissionRequest, blocks: Sequence[int] = ()) -> AdmissionRequest:
        """``request`` with the engine's ``blocks`` as a round takes it (a
        Struct built in Python is not validated); raises `RoundError` for what
        no rank could vote on or a parent already pending or in flight,
        `AdmissionStopped` while a rank restarts."""
        checked = check_admission(request.parent, request.num_tokens, blocks)
        self._check_admissible(request.parent)
        return msgspec.structs.replace(request, blocks=checked) if checked else request

    def _queue_admission(self, request: AdmissionRequest) -> asyncio.Future[bool]:
        """Queue a `_checked` request for the next round; answered by its decision."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending_admits[request.parent] = (request, future)
        return future

    async def submit(
        self,
        parent: ParentKey,
        num_tokens: int,
        release_when_ready: bool = False,
        blocks: Sequence[int] = (),
        peer_instance: str = "",
    ) -> str:
        """One handoff, driven by the ranks from here on; returns its outcome.

        For the coordinator of the GEN instance (constructed with ``peer``, the
        CTX coordinator's actor name). The admission joins the next round; the
        peer instance admits it in the same round's time (`admit_many`, one
        call per batch), and the round admits it only if both instances do
        (else it is cancelled where it was admitted). Then the ranks drive it:
        each GEN rank sends its OPENs when it applies the admission, the CTX
        rounds decide and publish, the GEN completion round makes it
        decode-ready. The answer is the decision that ends it here:
        "completed" (decode-ready on every GEN rank, every byte verified),
        "cancelled", "failed" or "rejected" (a side refused, or is
        restarting). The caller may go away at any point: nothing depends on
        it (with ``release_when_ready`` the GEN ranks return the blocks once
        verified; else the consumer frees them, or their consumer deadline
        does). Raises `TopologyFailed` once the topology failed and
        `RoundError` for a parent already pending or in flight.

        In a fleet (constructed with ``fleet``) ``peer_instance`` names the
        CTX instance to pair with; a draining instance raises
        `InstanceDraining` (nothing was queued)."""
        self.trace.record(parent.request_id, "submit", "call", "client")
        await self._ensure_started()
        return await self._enter(SubmitRequest(parent, num_tokens, release_when_ready, tuple(blocks), peer_instance))

    async def submit_many(self, requests: Sequence[SubmitRequest]) -> AsyncIterator[list[SubmitAnswer]]:
        """`submit` for many handoffs in one Ray call, their answers streamed
        back: a Ray streaming generator that yields, at each decision that
        ends some of them, the answers of those it ended (`SubmitAnswer`:
        the request's index and its outcome or the error its `submit` would
        raise). A request is checked and queued on its own: one refused
        (a bad request, a parent already in flight, a draining instance)
        is answered with its error at once and changes nothing, and the
        others go on. No answer waits for another's handoff."""
        self.calls["submit_many_calls"] += 1
        self.calls["submit_many_requests"] += len(requests)
        for request in requests:
            self.trace.record(request.parent.request_id, "submit", "call", "client")
        answers: list[SubmitAnswer] = []
        waiting: dict[asyncio.Future[str], int] = {}
        try:
            await self._ensure_started()
        except Exception as exc:  # the topology failed: every request is answered with it
            yield [SubmitAnswer(i, error=exc) for i in range(len(requests))]
            return
        for i, request in enumerate(requests):
            try:
                waiting[self._enter(request)] = i
            except Exception as exc:
                answers.append(SubmitAnswer(i, error=exc))
        if answers:
            yield answers
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            answers = []
            for future in done:
                i = waiting.pop(future)
                error = future.exception()
                answers.append(SubmitAnswer(i, None if error else future.result(), error))
            yield answers

    def _enter(self, request: SubmitRequest) -> asyncio.Future[str]:
        """Check and queue one submission (`submit`); returns the future its
        decision resolves. Raises, with nothing queued, what `submit` raises;
        while the topology restarts the future is "rejected" at once."""
        parent, peer_instance = request.parent, request.peer_instance
        if self._peer_name is None and not (self._fleet and peer_instance):
            raise CoordinatorError("submit needs a peer coordinator (constructed with peer=...)")
        self._raise_if_draining()
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if self.state is TopologyState.RECOVERING:
            outcome.set_result("rejected")
            return outcome
        alone = self._admits_alone and self._direct.get(peer_instance, False) and self._idle_for_alone()
        admission = self._checked(
            AdmissionRequest(
                parent, request.num_tokens, release_when_ready=request.release_when_ready, peer_instance=peer_instance
            ),
            request.blocks,
        )
        if not alone:
            self._queue_admission(admission)
        elif parent in self._alone_calls:
            raise ParentInFlight(f"parent {parent!r} is already pending or in flight")
        if request.release_when_ready:
            self._complete_at_decision.add(parent)
            if admission.blocks:
                self._returns_awaited.add(parent)
        self._peer_of.remember(parent, peer_instance, time.monotonic())
        self._submitted[parent] = outcome
        if alone:
            self._alone_calls[parent] = asyncio.ensure_future(self._admit_alone(admission))
        else:
            self._wakeup.set()
        return outcome

    async def cancel_many(self, parents: Sequence[ParentKey]) -> list[str | None]:
        """`cancel` for many parents in one call (one Ray hop, one round)."""
        await self._ensure_started()
        self.calls["cancels_asked"] += len(parents)
        loop = asyncio.get_running_loop()
        futures = []
        for parent in parents:
            if self._admits_alone and not self._knows(parent):
                # Perhaps admitted by our rank alone, its report not here yet
                # (a publish or a receive at the rank): cancelled once it is.
                self._cancelled_early.remember(parent, True, time.monotonic())
            future: asyncio.Future[str | None] = loop.create_future()
            self._pending_cancels.setdefault(parent, []).append(future)
            futures.append(future)
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def report(self, report: RankReport) -> bool:
        """A rank pushes its news (one way; `RankReport`): the next round
        decides on it without asking that rank for a vote. A report of another
        incarnation raises `VoteRejected` and changes nothing."""
        await self._ensure_started()
        assert self._leader is not None
        self.calls["reports_received"] += 1
        if self.trace.every:
            source = f"rank{report.rank}@{self.topology}"
            self.trace.record_many(news_ids(report), "report", carried_by(), source)
        return self._take_report(report)

    def _take_report(self, report: RankReport) -> bool:
        """Give ``report`` to the leader (raises as `RoundLeader.report`); a
        parent it brings in flight that was cancelled before we knew it (a
        receive at the rank) is cancelled now."""
        assert self._leader is not None
        fresh = self._leader.report(report)
        if fresh:
            if report.admitted and self._cancelled_early:
                for parent in report.admitted:
                    if self._cancelled_early.forget(parent) and parent in self._leader.in_flight:
                        self.calls["cancels_before_report"] += 1
                        self._pending_cancels.setdefault(parent, [])
            self._wakeup.set()
        return fresh

    def _own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._owned.add(task)
        task.add_done_callback(self._owned.discard)

    async def cancel(self, parent: ParentKey) -> str | None:
        """Cancel ``parent`` in the next round; returns its outcome in that
        round's decision ("cancelled", "failed", ...) or None if the
        coordinator does not know the parent."""
        await self._ensure_started()
        self.calls["cancels_asked"] += 1
        alone = self._alone_calls.get(parent)
        if alone is not None:
            await asyncio.shield(alone)  # the parent is in flight (or refused) once it answers
        if self._admits_alone and not self._knows(parent):
            # Perhaps received at our rank, its report not here yet.
            self._cancelled_early.remember(parent, True, time.monotonic())
        if self._peer_name is not None or parent in self._peer_of:
            # We admit in the peer instance too: cancel there as well. Sent
            # after any admission we asked it for (tasks start in creation
            # order), so it can never overtake that admission.
            self._own(self._peer_cancel([parent], self._peer_of.get(parent, "")))
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._pending_cancels.setdefault(parent, []).append(future)
        self._wakeup.set()
        return await future

    def _knows(self, parent: ParentKey) -> bool:
        """Is ``parent`` submitted, queued or in flight here?"""
        assert self._leader is not None
        return (
            parent in self._leader.in_flight
            or parent in self._pending_admits
            or parent in self._submitted
            or parent in self._alone_calls
        )

    async def nudge(self, rank: int | None = None, epoch: int | None = None) -> None:
        """A rank has news: run a round soon. Fire-and-forget for ranks; a
        nudge naming an old endpoint epoch raises `StaleEpochError`."""
        await self._ensure_started()
        if rank is not None:
            if not 0 <= rank < self._tp:
                raise RoundError(f"nudge from unknown rank {rank}")
            if epoch is not None and epoch != self._epochs[rank]:
                raise StaleEpochError(epoch, self._epochs[rank])
        self._want_votes = True  # its news was not pushed: ask every rank for a vote
        self._wakeup.set()

    async def watch(self) -> None:
        """Never answers while this coordinator lives: a caller awaiting it
        learns of the coordinator's death at once (Ray fails the call), with
        no polling. Ends (returns) at shutdown."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def drain(self, timeout: float) -> bool:
        """Stop admitting for good (`submit` and `admit_many` raise
        `InstanceDraining`; nothing queued is lost: what was queued before
        still runs) and wait until no handoff of this instance is pending or
        in flight, within ``timeout`` seconds. True once drained; False if
        the bound passed first (the instance stays draining: call again).
        Waits on the rounds' progress, not on a clock guess."""
        await self._ensure_started()
        self._draining = True
        if self.state is TopologyState.RUNNING:
            self.state = TopologyState.DRAINING
        leader = self._leader
        assert leader is not None
        if self._admits_at_open or self._admits_alone:
            # No round of ours refuses an OPEN (nor a receive at the rank):
            # our rank must. Its answer names what it admitted before, which
            # we wait for too.
            await asyncio.gather(*(self._close_admission(r) for r in range(self._tp)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def busy() -> bool:
            return bool(self._pending_admits or self._submitted or leader.in_flight)

        while busy():
            if self.state in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
                return False
            self._round_done.clear()
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await self._round_done.wait()
            except TimeoutError:
                return not busy()
        return True

    async def _close_admission(self, rank: int) -> None:
        """Close rank `rank`'s admission at the OPEN (draining) and take in
        its report; a rank that does not answer is the rounds' business."""
        assert self._leader is not None
        try:
            async with asyncio.timeout(self._round_timeout):
                report = await self._handles[rank].close_admission.remote()
            self._take_report(report)
        except Exception as exc:
            self._rank_errors.append(f"close admission of rank {rank}: {exc!r}"[:500])

    async def run_round(self) -> RoundDecision:
        """Run one round now, with or without news; returns its decision or
        raises `RoundTimeout` (after the fail policy ran)."""
        await self._ensure_started()
        self._want_votes = True
        return await self._run_round(wait_applied=True)

    async def outcome(self, parent: ParentKey) -> str | None:
        """The last decided outcome of ``parent`` (bounded memory), or None."""
        return self._outcomes.get(parent)

    async def decision_log(self) -> list[RoundDecision]:
        """The most recent decisions, oldest first (bounded)."""
        return list(self._decision_log.values())

    def _log_decision(self, decision: RoundDecision) -> None:
        self._last_decided = max(self._last_decided, decision.round_no)
        self._decisions_logged += 1
        self._decision_log.remember(self._decisions_logged, decision, time.monotonic())

    async def epochs(self) -> list[int]:
        """The current endpoint epoch of every rank."""
        await self._ensure_started()
        return list(self._epochs)

    async def rank_handles(self) -> list[Any]:
        """The current rank actor handles (rank i at index i)."""
        await self._ensure_started()
        return list(self._handles)

    async def set_trace(self, every: int, peer: str = "") -> None:
        """Trace one request in `every` (0: off) here and on every rank of this
        instance (a rank that cannot trace, or is restarting, is skipped; a
        new incarnation gets it when it joins). actors/_trace.py. `peer`:
        the paired instance's id, where admissions name none (a pair
        deployment), so a trace knows who sent them."""
        self.trace.set_every(every)
        self._trace_peer = f"coord@{peer}" if peer else ""
        await asyncio.gather(*(self._rank_set_trace(h) for h in self._handles))

    async def _rank_set_trace(self, handle: Any) -> None:
        set_trace = getattr(handle, "set_trace", None)
        if set_trace is not None:
            with contextlib.suppress(Exception):  # a dead rank traces nothing
                await set_trace.remote(self.trace.every)

    async def trace_events(self, request_id: str) -> list[TraceEvent]:
        """The events of a traced request here and on every rank (taken:
        forgotten there)."""
        calls = (h.trace_events.remote(request_id) for h in self._handles if hasattr(h, "trace_events"))
        return await with_events_of(self.trace.take(request_id), calls)

    async def stats(self) -> dict[str, Any]:
        """Counters and latencies (for the CLI, benchmarks and tests)."""
        seconds = sorted(self._round_seconds)
        now = time.monotonic()
        return {
            "topology": self.topology,
            "round_timeout_s": self._round_timeout,
            "state": self.state.value,
            "tp": self._tp,
            "next_round": self._leader.next_round if self._leader else 1,
            "rounds": self._rounds,
            "rounds_timed_out": self._rounds_timed_out,
            "restarts": self._restarts,
            "max_restarts": self._max_restarts,
            "restart_failures": self._restart_failures,
            "reclaim_restarts": self._reclaim_restarts,
            "blocks_reclaimed_by_restart": self._reclaimed_by_restart,
            "epochs": list(self._epochs),
            "detached": sorted(self._detached),
            "reattached": self._reattached,
            "in_flight": len(self._leader.in_flight) if self._leader else 0,
            "pending_admits": len(self._pending_admits),
            "pending_cancels": len(self._pending_cancels),
            "submitted": len(self._submitted),
            "admits_at_open": self._admits_at_open,
            "admits_alone": self._admits_alone,
            "peers_admitting_at_open": sorted(p for p, direct in self._direct.items() if direct),
            "calls": dict(self.calls),
            "decided": dict(self._counts),
            "rejected_votes": dict(self._rejected_votes),
            "round_s_mean": sum(seconds) / len(seconds) if seconds else None,
            "round_s_p50": seconds[len(seconds) // 2] if seconds else None,
            "round_s_max": seconds[-1] if seconds else None,
            "rank_errors": list(self._rank_errors),
            "timeouts": [str(t) for t in self._timeouts],
            "memory": {
                "resident_bytes": resident_bytes(),
                "outcomes": self._outcomes.stats(now),
                "peers": self._peer_of.stats(now),
                "decision_log": self._decision_log.stats(now),
            },
            "failure_reason": self._failure_reason,
            # CPU seconds this process spent so far, every thread (Ray's too).
            "cpu_s": time.process_time(),
        }


#: The coordinator as a Ray async actor: ``Coordinator.remote(topology, ...)``.
class _CoordinatorActor(CoordinatorCore):
    """The coordinator in its own process: its start-up heap frozen (actors/_heap.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        freeze_startup_heap()


Coordinator = ray.remote(num_cpus=0, max_restarts=0)(_CoordinatorActor)
