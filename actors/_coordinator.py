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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import ray
from ray.exceptions import ActorDiedError

from kvhandoff.actors._metrics import InstanceMetrics, resident_bytes
from kvhandoff.actors._trace import (
    SENT,
    TraceEvent,
    TraceRecorder,
    decision_ids,
    news_ids,
    proposal_ids,
)
from kvhandoff.protocol import (
    MAX_ROUND_ITEMS,
    AdmissionRequest,
    ParentKey,
    RankReport,
    RecentMemory,
    RoundDecision,
    RoundError,
    RoundLeader,
    RoundProposal,
    RoundTimedOut,
    RoundVote,
    StaleEpochError,
    VoteRejected,
    paired_outcome,
    pairing_undo,
    pairing_veto,
)

__all__ = [
    "Coordinator",
    "CoordinatorCore",
    "CoordinatorError",
    "RoundTimeout",
    "AdmissionStopped",
    "TopologyFailed",
    "TopologyState",
    "InstanceDraining",
]

RankFactory = Callable[[int, int], Any]  # (rank, epoch) -> ActorHandle

#: The byte budget of the recent round decisions a coordinator keeps (`decision_log`).
_DECISION_LOG_BYTES = 2 << 20

#: How long the apply of a decision that only settles completions nobody
#: waits on may wait for the next vote round to ride with (`lazy_apply_s`).
LAZY_APPLY_S = 0.005


class _Carried:
    """A decided round's apply riding with the next round's votes: the
    decision, the rank epochs it was decided for, and one future per rank
    resolved with the round number once that rank applied it, or with the
    error its call raised (a value, not an exception: the tail reads it)."""

    __slots__ = ("decision", "epochs", "replies", "lazy")

    def __init__(
        self, decision: RoundDecision, epochs: list[int], replies: list[asyncio.Future[Any]], lazy: bool = False
    ) -> None:
        self.decision = decision
        self.epochs = epochs
        self.replies = replies
        self.lazy = lazy  # may wait `lazy_apply_s` for a vote round (`CoordinatorCore._may_wait`)


async def _settle(future: asyncio.Future[Any], ref: Any) -> None:
    """Resolve a carried apply's `future` with what its lone call `ref` gives."""
    try:
        if ref is None:
            raise RuntimeError("the apply call could not be sent")
        answer = await ref
    except Exception as exc:
        answer = exc
    if not future.done():
        future.set_result(answer)


class CoordinatorError(Exception):
    """Base of the coordinator's errors (the actors layer; not protocol input errors)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the constructor arguments so the error survives a Ray hop intact.
        return (type(self), self._reduce_args)

    _reduce_args: tuple[Any, ...] = ()


class RoundTimeout(CoordinatorError):
    """Round ``round_no`` ended without a valid answer from ``missing_ranks``
    within the watchdog bound (``timeout_s``)."""

    def __init__(
        self, topology: str, round_no: int, missing_ranks: Sequence[int], timeout_s: float
    ) -> None:
        self._reduce_args = (topology, round_no, tuple(missing_ranks), timeout_s)
        super().__init__(
            f"topology {topology!r}: round {round_no} timed out after {timeout_s:g}s "
            f"waiting for ranks {list(missing_ranks)}"
        )
        self.topology = topology
        self.round_no = round_no
        self.missing_ranks = tuple(missing_ranks)
        self.timeout_s = timeout_s


class AdmissionStopped(CoordinatorError):
    """Admission is stopped while the topology recovers from a failed rank."""

    def __init__(self, topology: str, reason: str) -> None:
        self._reduce_args = (topology, reason)
        super().__init__(f"topology {topology!r}: admission stopped ({reason}); retry later")
        self.topology = topology
        self.reason = reason


class TopologyFailed(CoordinatorError):
    """The topology is FAILED (restart budget exhausted, or shut down): every
    call raises this."""

    def __init__(self, topology: str, reason: str) -> None:
        self._reduce_args = (topology, reason)
        super().__init__(f"topology {topology!r} failed: {reason}")
        self.topology = topology
        self.reason = reason


class InstanceDraining(AdmissionStopped):
    """The instance is draining (it leaves the fleet once its in-flight
    handoffs end): it admits nothing new. Not retried: route elsewhere."""


class TopologyState(str, enum.Enum):
    STARTING = "starting"  # rank actors not yet verified
    RUNNING = "running"  # rounds run, admission open
    DRAINING = "draining"  # no new admissions; in-flight handoffs finish (`drain`)
    RECOVERING = "recovering"  # a rank is being restarted: admission stopped
    FAILED = "failed"  # restart budget exhausted: every call raises TopologyFailed
    SHUT_DOWN = "shut_down"  # shutdown() was called


class CoordinatorCore:
    """The coordinator's implementation; `Coordinator` is this class as a Ray
    actor (``Coordinator.remote(...)``). Every public method is a coroutine.

    Parameters: ``topology`` (a name used in errors and stats); ``ranks`` (the
    rank actor handles, rank i at index i) and/or ``rank_factory`` (a
    picklable ``(rank, epoch) -> ActorHandle`` used to create the ranks when
    ``ranks`` is None, with ``tp`` ranks, and to restart them);
    ``round_timeout`` (seconds, per phase); ``max_restarts`` (topology-wide);
    ``batch_window`` (extra seconds to gather a batch); ``max_batch``
    (admissions per round); ``restart_timeout`` (bound on restarting one
    rank actor; the first start waits on progress instead, see
    `_identities`); ``restart_attempts`` (incarnations tried for one
    restart before the topology fails; failed tries back off from
    ``restart_backoff`` seconds, doubling, capped at ``restart_timeout``);
    ``topology_digest`` (checked by the followers if set);
    ``lazy_apply_s`` (how long the apply of a decision that only settles
    completions nobody waits on may wait for the next vote round to ride
    with; 0 sends every apply at once unless a vote round takes it).
    """

    def __init__(
        self,
        topology: str,
        ranks: Sequence[Any] | None = None,
        *,
        rank_factory: RankFactory | None = None,
        tp: int | None = None,
        round_timeout: float = 2.0,
        max_restarts: int = 3,
        batch_window: float = 0.0,
        max_batch: int = 1024,
        restart_timeout: float = 30.0,
        restart_attempts: int = 3,
        restart_backoff: float = 0.1,
        topology_digest: bytes | None = None,
        first_epoch: int = 1,
        peer: str | None = None,
        peer_claims: bool = False,
        fleet: str | None = None,
        reattach: str | None = None,
        lazy_apply_s: float = LAZY_APPLY_S,
        admits_at_open: bool = False,
        admits_alone: bool = False,
    ) -> None:
        if ranks is None and (rank_factory is None or not tp):
            raise ValueError("give the rank handles, or a rank_factory and tp")
        if not round_timeout > 0:
            raise ValueError("round_timeout must be positive")
        if not 1 <= max_batch <= MAX_ROUND_ITEMS:
            raise ValueError(f"max_batch must be in [1, {MAX_ROUND_ITEMS}]")
        if type(restart_attempts) is not int or restart_attempts < 1:
            raise ValueError(f"restart_attempts must be an int >= 1, got {restart_attempts!r}")
        if not restart_backoff >= 0:
            raise ValueError(f"restart_backoff must be >= 0, got {restart_backoff!r}")
        if not 0 <= lazy_apply_s < round_timeout:
            raise ValueError(f"lazy_apply_s must be in [0, round_timeout), got {lazy_apply_s!r}")
        self._lazy_apply_s = float(lazy_apply_s)
        self.topology = topology
        self._handles: list[Any] = list(ranks) if ranks is not None else []
        self._tp = len(self._handles) if ranks is not None else int(tp or 0)
        if admits_at_open and self._tp != 1:
            raise ValueError(f"admits_at_open is for an instance of one rank, got tp={self._tp}")
        if admits_alone and self._tp != 1:
            raise ValueError(f"admits_alone is for an instance of one rank, got tp={self._tp}")
        self._owns_ranks = ranks is None
        self._rank_factory = rank_factory
        self._round_timeout = float(round_timeout)
        self._max_restarts = max_restarts
        self._batch_window = batch_window
        self._max_batch = max_batch
        self._restart_timeout = restart_timeout
        self._restart_attempts = restart_attempts
        self._restart_backoff = float(restart_backoff)
        self._restart_failures = 0  # incarnations that failed to start (stats)
        self._digest = topology_digest
        self._peer_name = peer
        self._peer: Any = None
        # A fleet: the coordinator of peer instance I is the actor
        # `<fleet>.coord.<I>`; a submission names its peer instance ("": `peer`).
        self._fleet = fleet
        self._peers: dict[str, Any] = {}
        self._draining = False  # `drain()`: admit nothing new, ever again
        # Ranks we cannot restart (an engine's workers: `reattach` names the
        # deployment's directory): a failed one is detached until the engine
        # re-attaches a new incarnation (`replace_rank`); admission stays
        # stopped and no round runs meanwhile.
        self._reattach_directory = reattach
        self._detached: set[int] = set()
        self._reattached = 0
        self._stopped: asyncio.Event | None = None  # set by shutdown (`watch` returns)
        self._round_done = asyncio.Event()  # set after every round (drain waits on it)
        # Submitted parents -> their peer instance (for cancels): written at the
        # submission and again at each decision about the parent, so it is
        # kept while the parent lives and `RETAIN_S` after its last decision.
        self._peer_of: RecentMemory[ParentKey, str] = RecentMemory()
        self._next_epoch = first_epoch
        self._epochs: list[int] = []
        self._leader: RoundLeader | None = None
        # Exported through Ray (actors/_metrics.py): rounds, restarts, admission.
        self._metrics = InstanceMetrics.for_actor(topology)
        self.state = TopologyState.STARTING
        self._failure_reason = ""
        # Pending client work, taken in arrival order by the next round.
        self._pending_admits: dict[
            ParentKey, tuple[int, asyncio.Future[bool], bool, tuple[int, ...], str]
        ] = {}
        # Engine deployments: the peer (CTX) instance published the parent
        # already (`publish`); a submission claims it there (`claim_many`)
        # instead of admitting it. On the CTX side, the parents claimed once.
        self._peer_claims = peer_claims
        # Admission at the OPEN (docs/design.md "Admission at the OPEN").
        # CTX of one rank: that rank admits a parent at its first OPEN and
        # reports it (`admits_at_open`; this coordinator joins the rank
        # before it serves and closes its admission when it drains). GEN:
        # per peer instance, whether it admits at the OPEN (asked once per
        # peer incarnation, `_learn_direct`); a submitted handoff paired
        # with one asks no peer admission: the OPEN is it, and a refusal
        # comes back as a REJECT (NOT_STARTED) that fails the handoff.
        self._admits_at_open = admits_at_open
        # A GEN instance of one rank hands a submission paired with such a
        # peer to its rank (`_admit_alone`): no admission round at all. Its
        # calls still out, per parent (a cancel of it waits for its answer).
        self._admits_alone = admits_alone
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

    async def _identities(self) -> list[tuple[int, int]]:
        """Every rank's ``round_identity``, which it answers once constructed.

        Waits on progress, not on a wall-clock guess: a rank actor that is still
        starting (waiting for resources, still constructing) is not dead, so
        there is no bound here (the caller bounds the whole start, e.g.
        `Deployment.launch`'s ``start_timeout_s``, and can ask `start_status`
        which ranks are still starting). A rank actor that died while starting
        (its constructor raised, its node went away) fails the start at once:
        its call raises with the death cause, the topology is FAILED and
        `TopologyFailed` names the rank and why."""
        self._start_status = {rank: "starting" for rank in range(self._tp)}
        identities: list[tuple[int, int]] = [(-1, -1)] * self._tp

        async def identify(rank: int) -> None:
            try:
                rank_no, epoch = await self._handles[rank].round_identity.remote()
            except Exception as exc:
                self._start_status[rank] = f"died: {_death_cause(exc)}"
                raise
            identities[rank] = (rank_no, epoch)
            self._start_status[rank] = "started"

        try:
            async with asyncio.TaskGroup() as group:  # the first death cancels the other waits
                for rank in range(self._tp):
                    group.create_task(identify(rank))
        except ExceptionGroup as errors:
            dead = "; ".join(
                f"rank {rank} {why}" for rank, why in self._start_status.items() if why.startswith("died")
            )
            self._enter_failed(f"rank actors did not start: {dead}")
            raise TopologyFailed(self.topology, self._failure_reason) from errors.exceptions[0]
        return identities

    async def start_status(self) -> dict[int, str]:
        """Per rank, how its start is going: "started", "died: <cause>" or
        "starting (<Ray actor state>)". Answers at once, also while the start
        is in progress (for the launcher's error message)."""
        status = {}
        for rank in range(self._tp):
            why = self._start_status.get(rank, "starting")
            if why == "starting":
                known = rank < len(self._handles)
                why = f"starting ({_actor_state(self._handles[rank]) if known else 'not created yet'})"
            status[rank] = why
        return status

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
        future = self._queue_admission(parent, num_tokens, blocks=blocks)
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
            self._queue_admission(parent, tokens, peer_instance=peer_instance) for parent, tokens in requests
        ]
        self._admit_at_decision.update(parents)
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def claim_many(self, parents: Sequence[ParentKey]) -> list[bool]:
        """CTX of an engine deployment: the GEN coordinator claims parents
        this instance published (admitted through `admit` with the engine's
        block ids, the KV resident on every rank). True for a parent that is
        admitted here, still in flight and not claimed before (a ticket is
        claimed once: a second claim, a claim after its lease ran out or
        after a cancel, or of a parent never published is False). Raises
        `AdmissionStopped` while a rank restarts."""
        await self._ensure_started()
        if self.state is TopologyState.RECOVERING:
            raise AdmissionStopped(self.topology, self._failure_reason or "a rank is restarting")
        assert self._leader is not None
        in_flight = self._leader.in_flight
        self._claimed &= in_flight  # ended parents need no memory: they cannot be claimed
        answers = []
        for parent in parents:
            ok = parent in in_flight and parent not in self._claimed
            if ok:
                self._claimed.add(parent)
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
            or (proposal is not None and any(a.parent == parent for a in proposal.admissions))
        ):
            raise RoundError(f"parent {parent!r} is already pending or in flight")

    def _queue_admission(
        self,
        parent: ParentKey,
        num_tokens: int,
        release_when_ready: bool = False,
        blocks: Sequence[int] = (),
        peer_instance: str = "",
    ) -> asyncio.Future[bool]:
        _check_request(parent, num_tokens)
        blocks = _check_blocks(blocks)
        self._check_admissible(parent)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending_admits[parent] = (num_tokens, future, release_when_ready, blocks, peer_instance)
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
        if self._peer_name is None and not (self._fleet and peer_instance):
            raise CoordinatorError("submit needs a peer coordinator (constructed with peer=...)")
        self._raise_if_draining()
        if self.state is TopologyState.RECOVERING:
            return "rejected"
        alone = (
            self._admits_alone
            and not self._peer_claims
            and self._direct.get(peer_instance, False)
            and self._idle_for_alone()
        )
        if alone:
            _check_request(parent, num_tokens)
            blocks = _check_blocks(blocks)
            self._check_admissible(parent)
            if parent in self._alone_calls or parent in self._submitted:
                raise RoundError(f"parent {parent!r} is already pending or in flight")
        else:
            self._queue_admission(parent, num_tokens, release_when_ready, blocks, peer_instance)
        if release_when_ready:
            self._complete_at_decision.add(parent)
            if blocks:
                self._returns_awaited.add(parent)
        self._peer_of.remember(parent, peer_instance, time.monotonic())
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._submitted[parent] = outcome
        if alone:
            request = AdmissionRequest(
                parent=parent,
                num_tokens=num_tokens,
                release_when_ready=release_when_ready,
                blocks=blocks,
                peer_instance=peer_instance,
            )
            self._alone_calls[parent] = asyncio.ensure_future(self._admit_alone(request))
        else:
            self._wakeup.set()
        return await outcome

    def _idle_for_alone(self) -> bool:
        """May a submission be admitted alone now? Only while nothing else is
        under way here: no other submission waiting for its outcome, no
        admission queued, no round running, no admission alone out. Under load a round admits the whole batch with
        one call per rank, and the rank sends their OPENs in one frame call
        per peer; an admission alone is one call per handoff, and its OPENs
        go in a frame call of their own. Measured on the GPU host at 16
        clients per instance with every admission alone: rank frame calls per
        handoff 0.6 -> 2.0 and a third of a pair's rate lost. So a lone
        handoff takes the short path (two hops fewer) and a busy instance
        batches."""
        return not self._submitted and not self._pending_admits and not self._alone_calls and not self._round_lock.locked()

    async def _admit_alone(self, request: AdmissionRequest) -> None:
        """Hand ``request`` to this one-rank instance's rank, which admits it
        with no round (`admit_alone`; its CTX peer admits at the OPEN). The
        rank's report comes back with its answer and goes to the leader
        first, so the parent is in flight before a cancel of it (which waits
        for this call) is proposed. A refusal answers "rejected"; a rank
        that failed or restarted meanwhile, "failed" (whatever it admitted
        died with it: a new incarnation is a new pool)."""
        parent = request.parent
        self.calls["rank_admit_alone"] += 1
        if self.trace.every:
            self.trace.record(parent.request_id, f"{SENT}admit_alone", "local")
        # A decision kept to ride with a vote rides with this call instead
        # (no vote will come), to the incarnation it was decided for: the
        # rank applies it first, so the blocks its completions return are
        # free for this admission. Else the rank admits only once it applied
        # every decision up to here (one may still be on its way).
        carried, self._carried = self._carried, None
        epoch = self._epochs[0]
        rides = carried.decision if carried is not None and carried.epochs[0] == epoch else None
        replied: Any = StaleEpochError(epoch, carried.epochs[0]) if carried is not None and rides is None else None
        try:
            admitted, report = await self._handles[0].admit_alone.remote(request, epoch, self._last_decided, rides)
            if rides is not None:
                replied = rides.round_no
                self.calls["applies_carried"] += 1
        except Exception as exc:
            replied = exc
            self._rank_errors.append(f"rank 0: admit_alone({parent!r}): {exc!r}")
            admitted, report, outcome = False, None, "failed"
        else:
            outcome = "rejected"
        finally:
            self._alone_calls.pop(parent, None)
            if carried is not None and not carried.replies[0].done():
                carried.replies[0].set_result(replied)
        if report is not None and self._leader is not None:
            try:
                if self._leader.report(report):
                    self._wakeup.set()
            except RoundError:
                admitted, outcome = False, "failed"  # another incarnation's: it restarted meanwhile
        if admitted:
            return  # in flight: the decision that ends it answers the submission
        self._counts["rejected" if outcome == "rejected" else "failed"] += 1
        self._outcomes.remember(parent, outcome, time.monotonic())
        self._complete_at_decision.discard(parent)
        submitted = self._submitted.pop(parent, None)
        if submitted is not None and not submitted.done():
            submitted.set_result(outcome)

    def _peer_coordinator(self, instance: str = "") -> Any:
        """The coordinator of peer instance `instance` ("": the configured peer)."""
        if not instance:
            if self._peer is None:
                assert self._peer_name is not None
                self._peer = ray.get_actor(self._peer_name)
            return self._peer
        found = self._peers.get(instance)
        if found is None:
            found = self._peers[instance] = ray.get_actor(f"{self._fleet}.coord.{instance}")
        return found

    async def forget_peer(self, instance: str) -> None:
        """Peer instance `instance` left the fleet: drop its cached handle."""
        self._peers.pop(instance, None)
        self._direct.pop(instance, None)

    async def admits_at_open(self) -> bool:
        """Whether this instance's rank admits a handoff at its first OPEN
        (a GEN coordinator then asks it no admission)."""
        return self._admits_at_open

    def _ask_direct(self, admissions: list[AdmissionRequest]) -> None:
        """Start learning whether the peer instances of `admissions` admit at
        the OPEN (once per peer incarnation; until the answer, they are
        asked to admit as usual: the two ways of admitting mix safely, a
        CTX rank admits at an OPEN only a parent it does not hold)."""
        for peer in {a.peer_instance for a in admissions}:
            if peer not in self._direct and peer not in self._asking_direct:
                self._asking_direct.add(peer)
                self._own(self._learn_direct(peer))

    async def _learn_direct(self, peer: str) -> None:
        try:
            async with asyncio.timeout(self._round_timeout * 2):
                direct = bool(await self._peer_coordinator(peer).admits_at_open.remote())
        except Exception:
            direct = False  # gone, or does not say: admit it in its rounds
        finally:
            self._asking_direct.discard(peer)
        self._direct[peer] = direct

    async def cancel_many(self, parents: Sequence[ParentKey]) -> list[str | None]:
        """`cancel` for many parents in one call (one Ray hop, one round)."""
        await self._ensure_started()
        loop = asyncio.get_running_loop()
        futures = []
        for parent in parents:
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
            self.trace.record_many(news_ids(report), "report", "call", source)
        fresh = self._leader.report(report)
        if fresh:
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
        alone = self._alone_calls.get(parent)
        if alone is not None:
            await asyncio.shield(alone)  # the parent is in flight (or refused) once it answers
        if self._peer_name is not None or parent in self._peer_of:
            # We admit in the peer instance too: cancel there as well. Sent
            # after any admission we asked it for (tasks start in creation
            # order), so it can never overtake that admission.
            self._own(self._peer_cancel([parent], self._peer_of.get(parent, "")))
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._pending_cancels.setdefault(parent, []).append(future)
        self._wakeup.set()
        return await future

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
        if self._admits_at_open:
            # No round of ours refuses an OPEN: our rank must. Its answer
            # names what it admitted before, which we wait for too.
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
            if self._leader.report(report):
                self._wakeup.set()
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
        events = self.trace.take(request_id)
        found = await asyncio.gather(
            *(h.trace_events.remote(request_id) for h in self._handles if hasattr(h, "trace_events")),
            return_exceptions=True,
        )
        for more in found:
            if isinstance(more, list):
                events.extend(more)
        return events

    async def stats(self) -> dict[str, Any]:
        """Counters and latencies (for the CLI, benchmarks and tests)."""
        seconds = sorted(self._round_seconds)
        now = time.monotonic()
        return {
            "topology": self.topology,
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

    # -- the round loop -------------------------------------------------------------

    async def _round_loop(self) -> None:
        while True:
            if self._leader is not None and self._leader.reports_waiting():
                # Some rank reported its share of an intersection the others
                # have not: if nothing happens for a round bound, probe every
                # rank with a vote round. A rank that died holding its share
                # (its completion or prepared report never comes) is found by
                # it and restarted, instead of holding the others' reports
                # hostage; a slow but live rank just votes.
                try:
                    async with asyncio.timeout(self._round_timeout):
                        await self._wakeup.wait()
                except TimeoutError:
                    self._want_votes = True
                    self.calls["probe_rounds"] += 1
            else:
                await self._wakeup.wait()
            if self._batch_window > 0:
                await asyncio.sleep(self._batch_window)
            # Clear before taking the batch: anything queued from now on sets
            # the event again and gets the next round.
            self._wakeup.clear()
            if not self._work_pending():
                self._flush_idle()  # nothing to vote on after all: it goes alone
                continue  # e.g. the first reports of an intersection: wait for the rest
            try:
                await self._run_round()
            except RoundTimeout:
                pass  # the fail policy ran; keep serving
            except TopologyFailed:
                self._flush_carry()
                return
            if self._work_pending():
                self._wakeup.set()
            else:
                self._flush_idle()

    def _work_pending(self) -> bool:
        """Is there anything a round could decide now?"""
        leader = self._leader
        assert leader is not None
        if self._detached:
            return False  # no round without every rank: they wait for `replace_rank`
        return bool(
            self._pending_admits
            or self._pending_cancels
            or self._pending_failures
            or self._want_votes
            or leader.reports_decide()
        )

    async def _run_round(self, wait_applied: bool = False) -> RoundDecision:
        async with self._round_lock:
            while len(self._tails) > 1:  # at most one round's apply still out
                await asyncio.wait(list(self._tails)[:-1])
            if self.state in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
                self._flush_carry()  # no round takes it: the ranks still apply it
            self._raise_if_unusable()
            leader = self._leader
            assert leader is not None
            loop = asyncio.get_running_loop()
            admissions: list[AdmissionRequest] = []
            for parent, (num_tokens, _, release, blocks, peer) in self._pending_admits.items():
                if len(admissions) >= self._max_batch:
                    break
                admissions.append(
                    AdmissionRequest(
                        parent=parent,
                        num_tokens=num_tokens,
                        release_when_ready=release,
                        blocks=blocks,
                        peer_instance=peer,
                    )
                )
            cancels = list(self._pending_cancels)[:MAX_ROUND_ITEMS]
            failures = sorted(self._pending_failures & leader.in_flight, key=_key)
            failures = failures[:MAX_ROUND_ITEMS]
            started = time.perf_counter()
            proposal = leader.open_round(
                admissions,
                cancels,
                now=loop.time(),
                timeout=self._round_timeout,
                failures=failures,
            )
            # Taken: from here on these are answered by this round's decision.
            taken_admits = {a.parent: self._pending_admits.pop(a.parent)[1] for a in admissions}
            taken_cancels = {p: self._pending_cancels.pop(p) for p in cancels}
            self._pending_failures.clear()
            # Submitted handoffs need the peer instance to admit them too: ask
            # it now, in one call, while our ranks vote.
            paired = [
                a for a in admissions if a.parent in self._submitted and not self._direct.get(a.peer_instance, False)
            ]
            if paired and not self._peer_claims:
                self._ask_direct(paired)
            peer_answer = (
                asyncio.ensure_future(self._peers_admit(paired)) if paired else None
            )

            want_votes, self._want_votes = self._want_votes, False
            if admissions or want_votes:
                carried, self._carried = self._carried, None
                outcome = await self._vote_phase(proposal, peer_answer, carried, [a.parent for a in paired])
            else:
                self._flush_carry()
                # No lease to ask for: decide on the news the ranks pushed.
                leader.votes_from_reports(loop.time())
                outcome = leader.close(loop.time())
                self.calls["rounds_without_votes"] += 1
            if not isinstance(outcome, RoundTimedOut):
                decision = outcome
                self._log_decision(decision)  # made: logged before anyone hears it
                self._answer_early(decision, taken_admits)
                # Sent now, or with the next round's votes when that round
                # asks for them at once (a rank applies it, in its turn,
                # before it votes there); awaited by the round's tail while
                # the next round may already vote.
                if wait_applied:
                    sent = self._send_apply(decision)
                elif self._next_round_votes():
                    sent = self._carry_apply(decision)
                elif self._may_wait(decision):
                    sent = self._carry_apply(decision, lazy=True)
                else:
                    sent = self._send_apply(decision)
                self._undo_pairing(decision, peer_answer)
                earlier = list(self._tails)  # recorded after these, in round order
                tail = self._own_tail(self._round_tail(decision, sent, earlier, taken_admits, taken_cancels, started))
                if wait_applied:
                    await asyncio.shield(tail)
                return decision
            decision = outcome.decision
            self._log_decision(decision)
            bad = set(outcome.missing_ranks)
            survivors = [r for r in range(self._tp) if r not in bad]
            bad |= await self._apply_phase(decision, survivors)
            self._undo_pairing(decision, peer_answer)
            await self._tails_done()  # decisions are recorded in round order
            self._record(decision, taken_admits, taken_cancels, time.perf_counter() - started)
            if bad:
                timeout = RoundTimeout(
                    self.topology, decision.round_no, sorted(bad), self._round_timeout
                )
                self._timeouts.append(timeout)
                self._rounds_timed_out += 1
                self._metrics.round_timed_out()
                await self._fail_policy(sorted(bad), str(timeout))
                raise timeout
            return decision

    def _undo_pairing(self, decision: RoundDecision, peer_answer: asyncio.Future[set[ParentKey]] | None) -> None:
        """The peer admitted what we did not: take it back there (once its
        answer is in; it is by the time the round decided)."""
        if peer_answer is None:
            return

        async def undo() -> None:
            peer_ok = await peer_answer
            undo = pairing_undo(sorted(peer_ok, key=_key), set(decision.admitted))
            for instance in sorted({self._peer_of.get(p, "") for p in undo}):
                await self._peer_cancel([p for p in undo if self._peer_of.get(p, "") == instance], instance)

        self._own(undo())

    # -- a round's tail: its apply, awaited while the next round runs -----------------

    def _next_round_votes(self) -> bool:
        """Will the next round open at once and ask every rank for its vote?
        Then this round's apply can ride with it (one call per rank instead
        of two). Not with a batch window: the apply would wait for it."""
        return self._batch_window <= 0 and bool(self._pending_admits or self._want_votes)

    def _may_wait(self, decision: RoundDecision) -> bool:
        """May ``decision``'s apply wait up to `lazy_apply_s` for a vote
        round to ride with? Only when it settles completions and nothing
        else, and nobody waits for it to be applied: the caller of each
        parent was answered at the decision (its GEN ranks return the
        blocks themselves) or there is none. Admissions, decides, cancels,
        failures and rejections go at once: a handoff or a release waits
        on them."""
        if self._lazy_apply_s <= 0 or self._batch_window > 0 or not decision.completed:
            return False
        if decision.admitted or decision.rejected or decision.cancelled or decision.failed or decision.decided:
            return False
        if not self._returns_awaited.isdisjoint(decision.completed):
            return False  # an engine waits for these blocks to come back
        return not any(parent in self._submitted for parent in decision.completed)

    def _carry_apply(self, decision: RoundDecision, *, lazy: bool = False) -> list[tuple[int, int, Any]]:
        """Keep ``decision`` for the next round's vote calls: (rank, epoch,
        future) each, the future resolved with the round number when that
        rank's vote call returns, or with the error it raised. Whatever
        takes the round lock next either sends it with its votes or sends it
        alone (`_flush_carry`); so does the loop when it goes idle, or, for
        a `lazy` one (`_may_wait`), `lazy_apply_s` later at the latest."""
        self._flush_carry()  # at most one decision rides at a time
        loop = asyncio.get_running_loop()
        carried = _Carried(decision, list(self._epochs), [loop.create_future() for _ in range(self._tp)], lazy)
        self._carried = carried
        if lazy:
            self.calls["applies_delayed"] += 1
            loop.call_later(self._lazy_apply_s, self._flush_lazy, carried)
        else:
            self._wakeup.set()  # the round that takes it
        return [(rank, carried.epochs[rank], carried.replies[rank]) for rank in range(self._tp)]

    def _flush_lazy(self, carried: _Carried) -> None:
        if self._carried is carried:  # no round took it within the window
            self._flush_carry()

    def _flush_idle(self) -> None:
        """The loop goes idle: a carried apply goes alone, unless it may
        wait out its window (`_flush_lazy` sends it then)."""
        if self._carried is not None and not self._carried.lazy:
            self._flush_carry()

    def _flush_carry(self) -> None:
        """Send the carried decision alone, now (no vote round takes it)."""
        carried, self._carried = self._carried, None
        if carried is None:
            return
        for rank, _, ref in self._send_apply(carried.decision, carried.epochs):
            self._own(_settle(carried.replies[rank], ref))

    def _send_apply(self, decision: RoundDecision, epochs: Sequence[int] | None = None) -> list[tuple[int, int, Any]]:
        """Send ``decision`` to every rank now: (rank, epoch, reply) each."""
        sent = []
        for rank in range(self._tp):
            self.calls["rank_apply_calls"] += 1
            epoch = self._epochs[rank] if epochs is None else epochs[rank]
            try:
                sent.append((rank, epoch, self._handles[rank].round_apply.remote(decision, epoch)))
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                sent.append((rank, epoch, None))
        return sent

    def _own_tail(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tails.append(task)
        task.add_done_callback(self._tails.remove)
        return task

    async def _tails_done(self) -> None:
        """Wait until every earlier round's tail has ended (never raises)."""
        while self._tails:
            await asyncio.wait(list(self._tails))

    async def _round_tail(
        self,
        decision: RoundDecision,
        sent: list[tuple[int, int, Any]],
        earlier: list[asyncio.Task[None]],
        taken_admits: dict[ParentKey, asyncio.Future[bool]],
        taken_cancels: dict[ParentKey, list[asyncio.Future[str | None]]],
        started: float,
    ) -> None:
        """Await every rank's apply of ``decision`` (under the watchdog), then
        record it, after every earlier round's record. A rank that failed to
        apply it (and was not restarted meanwhile) is behind and holds shards
        of every in-flight parent: they fail in the next round, which asks for
        votes and so finds the rank (a dead or broken one misses its vote and
        the fail policy runs there, as for any missed vote)."""
        answered: set[int] = set()

        async def reply(rank: int, ref: Any) -> None:
            try:
                if ref is None:
                    raise RuntimeError("the apply call could not be sent")
                answer = await ref
                if isinstance(answer, BaseException):  # carried: its vote call raised
                    raise answer
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                return
            answered.add(rank)
            if self.trace.every:
                ids = decision_ids(decision)
                self.trace.record_many(ids, "round_apply", "reply", f"rank{rank}@{self.topology}")

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._round_timeout):
                await asyncio.gather(*(reply(rank, ref) for rank, _, ref in sent))
        # Failed or missed the watchdog, and not restarted since (a restart
        # already failed what that incarnation held).
        bad = [r for r, epoch, _ in sent if r not in answered and self._epochs[r] == epoch]
        if earlier:
            await asyncio.wait(earlier)
        self._record(decision, taken_admits, taken_cancels, time.perf_counter() - started)
        if bad and self.state not in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
            leader = self._leader
            assert leader is not None
            self._pending_failures |= leader.in_flight
            self._want_votes = True
            self.calls["apply_failures"] += 1
            self._wakeup.set()

    def _answer_early(self, decision: RoundDecision, taken_admits: dict[ParentKey, asyncio.Future[bool]]) -> None:
        """Answer, from the decision itself, what needs no rank to have applied it:

        - the peer instance's admissions (`admit_many`): our ranks leased in
          their vote and apply the admission next; an OPEN the peer's ranks
          send meanwhile waits on our rank until it applied (a CTX rank parks
          frames of a parent it leased but has not applied: `RankCore`);
        - a submission whose GEN ranks release the blocks themselves, when it
          completed: every GEN rank verified its bytes before it reported, and
          nobody frees the blocks (they go back when the ranks apply).

        The rest is answered once every rank applied (`_record`). A decision
        is final: a rank that fails to apply it is restarted by the fail
        policy, as when it fails right after applying."""
        admitted = set(decision.admitted)
        for parent, future in taken_admits.items():
            if parent in self._admit_at_decision and not future.done():
                self._admit_at_decision.discard(parent)
                future.set_result(parent in admitted)
        for parent in decision.completed:
            if parent in self._complete_at_decision:
                self._complete_at_decision.discard(parent)
                submitted = self._submitted.pop(parent, None)
                if submitted is not None and not submitted.done():
                    submitted.set_result("completed")
                    self.calls["answered_at_decision"] += 1

    async def _peers_admit(self, admissions: list[AdmissionRequest]) -> set[ParentKey]:
        """The parents their peer instances admitted: one call per peer
        instance, all at once (a fleet pairs one round's batch with many)."""
        by_peer: dict[str, list[AdmissionRequest]] = {}
        for a in admissions:
            by_peer.setdefault(a.peer_instance, []).append(a)
        answers = await asyncio.gather(*(self._peer_admit(peer, batch) for peer, batch in by_peer.items()))
        return set().union(*answers)

    async def _peer_admit(self, instance: str, admissions: list[AdmissionRequest]) -> set[ParentKey]:
        """The parents peer instance `instance` admitted (none if it refused,
        is restarting or draining, failed or did not answer within the round
        bound)."""
        self.calls["peer_admit_calls"] += 1
        # The peer's ranks learn which instance of ours each parent pairs with.
        ours = self.topology if self._fleet else ""
        if self.trace.every:  # sent while our ranks vote: mark it (actors/_trace.py)
            ids = [a.parent.request_id for a in admissions]
            self.trace.record_many(ids, f"{SENT}admit_many", "local")
        try:
            async with asyncio.timeout(self._round_timeout * 2):
                if self._peer_claims:
                    answers = await self._peer_coordinator(instance).claim_many.remote([a.parent for a in admissions])
                else:
                    answers = await self._peer_coordinator(instance).admit_many.remote(
                        [(a.parent, a.num_tokens) for a in admissions], ours
                    )
            if self.trace.every:
                source = f"coord@{instance}" if instance else self._trace_peer
                ids = [a.parent.request_id for a in admissions]
                self.trace.record_many(ids, "admit_many", "reply", source)
        except Exception as exc:
            self._rank_errors.append(f"peer admission: {exc!r}"[:500])
            if not isinstance(exc, AdmissionStopped):
                # Not a refusal (it is restarting: retry later) but a failure:
                # the peer died, failed, or did not answer in time.
                for a in admissions:
                    self._peer_failed.add(a.parent)
            # It may still admit them later (a slow answer): cancel there.
            self._own(self._peer_cancel([a.parent for a in admissions], instance))
            return set()
        return {a.parent for a, ok in zip(admissions, answers) if ok}

    async def _peer_cancel(self, parents: list[ParentKey], instance: str = "") -> None:
        self.calls["peer_cancel_calls"] += 1
        try:
            await self._peer_coordinator(instance).cancel_many.remote(parents)
        except Exception as exc:
            self._rank_errors.append(f"peer cancel: {exc!r}"[:500])

    async def _vote_phase(
        self,
        proposal: RoundProposal,
        peer_answer: asyncio.Future[set[ParentKey]] | None = None,
        carried: _Carried | None = None,
        paired: Sequence[ParentKey] = (),
    ) -> RoundDecision | RoundTimedOut:
        """Ask every rank's vote on ``proposal`` and decide. ``paired``: the
        admissions the peer instances were asked to admit too (``peer_answer``,
        their answer); one they did not admit is vetoed here. The others (a
        peer that admits at the OPEN) are decided on our votes alone."""
        leader = self._leader
        assert leader is not None
        loop = asyncio.get_running_loop()
        bad: set[int] = set()

        async def ask(rank: int) -> bool:
            self.calls["rank_vote_calls"] += 1
            epoch = self._epochs[rank]
            # The previous round's decision rides along, to the incarnation
            # it was decided for (a new one joined after it: not its decision).
            rides = carried.decision if carried is not None and carried.epochs[rank] == epoch else None
            replied: Any = StaleEpochError(epoch, carried.epochs[rank]) if carried is not None and rides is None else None
            try:
                vote: RoundVote = await self._handles[rank].round_vote.remote(proposal, epoch, rides)
                if rides is not None:
                    replied = rides.round_no
                    self.calls["applies_carried"] += 1
            except Exception as exc:  # died, broken, stale epoch: all a failed rank
                replied = exc
                self._rank_errors.append(f"round {proposal.round_no} rank {rank}: {exc!r}"[:500])
                bad.add(rank)
                return False
            finally:
                if carried is not None and not carried.replies[rank].done():
                    # Cut by the watchdog: whether it applied is unknown, so it did not.
                    carried.replies[rank].set_result(replied if replied is not None else TimeoutError("vote call cut"))
            if self.trace.every:
                ids = [*proposal_ids(proposal), *news_ids(vote)]
                self.trace.record_many(ids, "round_vote", "reply", f"rank{rank}@{self.topology}")
            try:
                leader.receive_vote(vote, loop.time())
            except VoteRejected as rejected:
                self._rejected_votes[rejected.reason.value] += 1
                self._rank_errors.append(str(rejected))
                bad.add(rank)
                return False
            return True

        # No early stop: a vote we cancelled would count as missing, and the fail
        # policy would restart a healthy rank (seen as a CI flake: a stale-epoch
        # vote from one rank got the other, healthy rank restarted too). The
        # watchdog still bounds the phase; only ranks that failed or truly
        # missed the deadline are blamed.
        await self._fan_out(ask, range(self._tp))
        if not bad and not leader.missing():
            vetoed: frozenset[ParentKey] = frozenset()
            if peer_answer is not None:
                vetoed = pairing_veto(list(paired), await peer_answer)
            return leader.close(loop.time(), vetoed=vetoed)
        return leader.abort(bad, loop.time())

    async def _apply_phase(self, decision: RoundDecision, ranks: Sequence[int]) -> set[int]:
        """Send ``decision`` to ``ranks``; returns the ranks that failed or
        missed the watchdog bound."""
        done: set[int] = set()

        async def tell(rank: int) -> bool:
            self.calls["rank_apply_calls"] += 1
            try:
                await self._handles[rank].round_apply.remote(decision, self._epochs[rank])
            except Exception as exc:
                self._rank_errors.append(f"apply {decision.round_no} rank {rank}: {exc!r}"[:500])
                return False
            if self.trace.every:
                ids = decision_ids(decision)
                self.trace.record_many(ids, "round_apply", "reply", f"rank{rank}@{self.topology}")
            done.add(rank)
            return True

        # Every survivor must get the decision: no early stop here.
        await self._fan_out(tell, ranks)
        return set(ranks) - done

    async def _fan_out(self, call: Callable[[int], Awaitable[bool]], ranks: Sequence[int]) -> None:
        """Run ``call(rank)`` for every rank under the watchdog (one
        ``asyncio.timeout`` around one TaskGroup that owns every task). Every
        call runs to its end or to the deadline, which cancels whatever is left:
        cancelling a healthy rank's call early would make it look missing.
        """
        try:
            async with asyncio.timeout(self._round_timeout), asyncio.TaskGroup() as group:
                for rank in ranks:
                    group.create_task(call(rank))
        except TimeoutError:
            pass

    def _record(
        self,
        decision: RoundDecision,
        taken_admits: dict[ParentKey, asyncio.Future[bool]],
        taken_cancels: dict[ParentKey, list[asyncio.Future[str | None]]],
        seconds: float,
    ) -> None:
        self._rounds += 1
        self._round_done.set()
        self._round_seconds.append(seconds)
        batch = len(decision.admitted) + len(decision.rejected) + len(decision.decided) + len(decision.settled())
        self._metrics.round(seconds, batch)
        outcomes: dict[ParentKey, str] = {}
        for name in ("admitted", "rejected", "cancelled", "completed", "failed"):
            parents = getattr(decision, name)
            self._counts[name] += len(parents)
            for parent in parents:
                outcomes[parent] = name
        now = time.monotonic()
        for parent, name in outcomes.items():
            self._outcomes.remember(parent, name, now)
            peer = self._peer_of.get(parent)
            if peer is not None:
                self._peer_of.remember(parent, peer, now)  # kept RETAIN_S past its last decision
        admitted = set(decision.admitted)
        for parent, future in taken_admits.items():
            self._admit_at_decision.discard(parent)
            if not future.done():
                future.set_result(parent in admitted)
        for parent, name in outcomes.items():
            if name == "admitted":
                continue
            self._complete_at_decision.discard(parent)
            self._returns_awaited.discard(parent)
            submitted = self._submitted.pop(parent, None)
            name = paired_outcome(name, parent in self._peer_failed)
            self._peer_failed.discard(parent)
            if submitted is not None and not submitted.done():
                submitted.set_result(name)
        for parent, waiters in taken_cancels.items():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(outcomes.get(parent))

    # -- fail policy ------------------------------------------------------------------

    async def _fail_policy(self, ranks: Sequence[int], reason: str) -> None:
        """Stop admission, restart ``ranks`` with new epochs, resume admission;
        enter FAILED when the restart budget runs out."""
        self.state = TopologyState.RECOVERING
        self._failure_reason = reason
        self._fail_admits(AdmissionStopped(self.topology, reason))
        for rank in ranks:
            await self._restart_rank(rank, reason, budgeted=True)
        if self._detached:
            return  # admission stays stopped until the engine re-attaches them
        self.state = self._serving_state()
        self._failure_reason = ""

    def _serving_state(self) -> TopologyState:
        return TopologyState.DRAINING if self._draining else TopologyState.RUNNING

    async def _restart_rank(self, rank: int, reason: str, *, budgeted: bool) -> None:
        """Kill ``rank``'s incarnation, tell the factory it is retired, and start
        a new incarnation (new epoch) that joins at the leader's next round.
        ``budgeted`` restarts (failures) count against ``max_restarts``."""
        leader = self._leader
        assert leader is not None
        # Kill the old incarnation first: it must never act again, even if it
        # was only slow (its epoch is dead from here on). Then tell whoever
        # holds sessions with it (the factory knows how, e.g. through the
        # deployment's directory, which confirms the death before it tells the
        # peers that the incarnation is dead: their proof for reclaiming).
        if self._rank_factory is None and self._reattach_directory is not None:
            # Not ours to restart (nor to kill: the engine owns the process):
            # detached until `replace_rank`. Its peers end their sessions
            # with the old incarnation now, and reclaim once the directory
            # confirmed it dead.
            self._retire(rank, self._epochs[rank])
            self._detached.add(rank)
            self._rank_errors.append(f"rank {rank} detached: {reason}"[:500])
            return
        _kill(self._handles[rank])
        retired = getattr(self._rank_factory, "retired", None)
        if retired is not None:
            with contextlib.suppress(Exception):
                retired(rank, self._epochs[rank])
        # Bounded: a rank that cannot start (its node is gone, its
        # constructor fails) is tried `restart_attempts` times, backing off
        # between tries, then the topology fails. The round lock is held
        # meanwhile (no round may run without every rank), so an unbounded
        # retry would freeze the whole instance.
        for attempt in range(self._restart_attempts + 1):
            if self._rank_factory is None:
                self._enter_failed(f"{reason}; no rank_factory to restart rank {rank}")
                raise TopologyFailed(self.topology, self._failure_reason)
            if budgeted and self._restarts >= self._max_restarts:
                self._enter_failed(f"{reason}; restart budget ({self._max_restarts}) exhausted")
                raise TopologyFailed(self.topology, self._failure_reason)
            if attempt == self._restart_attempts:
                self._enter_failed(
                    f"{reason}; rank {rank} did not start in {self._restart_attempts} attempts"
                )
                raise TopologyFailed(self.topology, self._failure_reason)
            if attempt:
                await asyncio.sleep(min(self._restart_backoff * 2 ** (attempt - 1), self._restart_timeout))
            if budgeted:
                self._restarts += 1
            epoch = self._take_epoch()
            handle = None
            try:
                handle = self._rank_factory(rank, epoch)
                async with asyncio.timeout(self._restart_timeout):
                    identity = await handle.round_identity.remote()
                    if tuple(identity) != (rank, epoch):
                        raise RoundError(
                            f"restarted rank reports {identity}, want {(rank, epoch)}"
                        )
                    await handle.round_join.remote(leader.next_round, epoch)
                    if self._admits_at_open and self._draining:
                        await handle.close_admission.remote()  # joined into a drain: it admits nothing
            except Exception as exc:
                self._restart_failures += 1
                self._rank_errors.append(f"restart rank {rank} epoch {epoch}: {exc!r}"[:500])
                if handle is not None:
                    _kill(handle)
                continue
            leader.set_epoch(rank, epoch)
            self._epochs[rank] = epoch
            self._handles[rank] = handle
            self._watch_rank(rank)
            if self.trace.every:
                self._own(self._rank_set_trace(handle))
            self._metrics.restarted("failure" if budgeted else "quarantine")
            return

    def _retire(self, rank: int, epoch: int) -> None:
        """Tell the directory that incarnation `epoch` of `rank` is gone
        (fire-and-forget): peers end their sessions with it, and hear
        `peer_dead` once it is confirmed dead."""
        assert self._reattach_directory is not None
        with contextlib.suppress(Exception):
            ray.get_actor(self._reattach_directory).retire.remote(self.topology, rank, epoch)

    async def replace_rank(self, rank: int, handle: Any) -> int:
        """An engine re-attaches rank `rank` as a new incarnation: `handle`
        hosts a new endpoint (a new epoch, its own new NIXL agent, over the
        engine's tensors), e.g. after the engine restarted that worker. The
        old incarnation is retired (if it still runs, it is fenced: its epoch
        is stale everywhere), every parent still in flight in this instance
        fails (the new incarnation holds none of them), and the new one joins
        at the next round; admission resumes once no rank is detached.
        Returns the new epoch. Only for instances constructed with
        ``reattach``; raises `RoundError` for a rank out of range, an
        incarnation that is not newer, or one that does not answer as `rank`
        within the restart bound (nothing changes then)."""
        await self._ensure_started()
        if self._reattach_directory is None:
            raise CoordinatorError("replace_rank is for instances whose ranks an engine hosts (reattach=...)")
        if not 0 <= rank < self._tp:
            raise RoundError(f"rank {rank} is not in [0, {self._tp})")
        async with self._round_lock:
            self._flush_carry()  # the decided round's apply goes before epochs change
            self._raise_if_unusable()
            leader = self._leader
            assert leader is not None
            try:
                async with asyncio.timeout(self._restart_timeout):
                    answered, epoch = await handle.round_identity.remote()
            except Exception as exc:
                raise RoundError(f"the new incarnation of rank {rank} did not answer: {exc!r}") from None
            if answered != rank or epoch <= self._epochs[rank]:
                raise RoundError(
                    f"rank {rank} epoch {self._epochs[rank]} can only be replaced by a newer incarnation of "
                    f"that rank, got rank {answered} epoch {epoch}"
                )
            old = self._epochs[rank]
            reason = f"rank {rank} re-attached (epoch {old} -> {epoch})"
            self.state = TopologyState.RECOVERING
            self._failure_reason = reason
            self._fail_admits(AdmissionStopped(self.topology, reason))
            self._pending_failures |= leader.in_flight
            if rank not in self._detached:
                self._retire(rank, old)  # the engine replaced a rank we still held: fence it
            await handle.round_join.remote(leader.next_round, epoch)
            leader.set_epoch(rank, epoch)
            self._epochs[rank] = epoch
            self._handles[rank] = handle
            self._watch_rank(rank)
            if self.trace.every:
                self._own(self._rank_set_trace(handle))
            self._detached.discard(rank)
            self._metrics.restarted("reattach")
            self._reattached += 1
            if not self._detached:
                self.state = self._serving_state()
                self._failure_reason = ""
        self._wakeup.set()
        return epoch

    def _watch_rank(self, rank: int) -> None:
        """Learn of rank `rank`'s death at once: its `watch` never answers
        while it lives. A death makes the next round a vote round, which
        finds it and runs the fail policy (as a missed deadline would, only
        without waiting for the next round to happen)."""
        handle, epoch = self._handles[rank], self._epochs[rank]

        async def watch() -> None:
            try:
                await handle.watch.remote()
            except ActorDiedError:
                if self._epochs[rank] == epoch and self.state not in (TopologyState.FAILED, TopologyState.SHUT_DOWN):
                    self.calls["rank_deaths_seen"] += 1
                    self._want_votes = True
                    self._wakeup.set()
            except Exception:
                pass  # a host without `watch`, or a call that broke otherwise: the rounds still find it

        self._own(watch())

    async def request_restart(self, rank: int, epoch: int, quarantined: int = 0) -> bool:
        """A rank past its quarantine limit, holding nothing else, asks to be
        restarted: a new incarnation has a fresh, fully free pool (docs/design.md
        "Quarantine and reclaim"). Admission stops while it restarts; every
        parent still in flight is failed in the next round (the new incarnation
        holds none of them). Not counted against ``max_restarts`` (a failure
        budget): each one needs the quarantine limit crossed again. Returns
        False for a stale request (an older epoch, or not running)."""
        await self._ensure_started()
        if not 0 <= rank < self._tp:
            raise RoundError(f"restart request from unknown rank {rank}")
        async with self._round_lock:
            self._flush_carry()  # the decided round's apply goes before epochs change
            if epoch != self._epochs[rank] or self.state not in (TopologyState.RUNNING, TopologyState.DRAINING):
                return False
            leader = self._leader
            assert leader is not None
            reason = f"rank {rank} asked for a restart: {quarantined} blocks quarantined"
            self.state = TopologyState.RECOVERING
            self._failure_reason = reason
            self._fail_admits(AdmissionStopped(self.topology, reason))
            self._pending_failures |= leader.in_flight
            self._reclaim_restarts += 1
            self._reclaimed_by_restart += quarantined
            await self._restart_rank(rank, reason, budgeted=False)
            self.state = self._serving_state()
            self._failure_reason = ""
        self._wakeup.set()
        return True

    def _enter_failed(self, reason: str) -> None:
        self.state = TopologyState.FAILED
        self._failure_reason = reason
        self._fail_pending(TopologyFailed(self.topology, reason))
        # The loop task ends by itself on the TopologyFailed it gets next.

    def _fail_admits(self, error: Exception) -> None:
        admits, self._pending_admits = self._pending_admits, {}
        for parent, (_, future, _, _, _) in admits.items():
            self._admit_at_decision.discard(parent)
            self._complete_at_decision.discard(parent)
            self._returns_awaited.discard(parent)
            if not future.done():
                future.set_exception(error)
            submitted = self._submitted.pop(parent, None)
            if submitted is not None and not submitted.done():
                if isinstance(error, AdmissionStopped):
                    submitted.set_result("rejected")
                else:
                    submitted.set_exception(error)

    def _fail_pending(self, error: Exception) -> None:
        self._fail_admits(error)
        self._complete_at_decision.clear()
        self._returns_awaited.clear()
        submitted, self._submitted = self._submitted, {}
        for future in submitted.values():
            if not future.done():
                future.set_exception(error)
        cancels, self._pending_cancels = self._pending_cancels, {}
        for futures in cancels.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)


def _check_request(parent: ParentKey, num_tokens: int) -> None:
    """Refuse what no rank could vote on, before it reaches a round: the key is
    re-validated against its wire schema (a Struct built in Python is not), and
    the size must be a positive int (bool is not)."""
    if type(num_tokens) is not int or not 0 < num_tokens < 2**32:
        raise RoundError(f"num_tokens must be a positive int below 2**32, got {num_tokens!r}")
    try:
        msgspec.convert(msgspec.to_builtins(parent), ParentKey)
    except (msgspec.ValidationError, TypeError) as exc:
        raise RoundError(f"invalid parent {parent!r}: {exc}") from None


def _check_blocks(blocks: Any) -> tuple[int, ...]:
    """An engine's block ids for one admission, checked against the round
    message's own bounds (the ranks check them against their pools)."""
    try:
        request = msgspec.convert(
            {"parent": {"request_id": "r", "ctx_attempt": 0, "gen_attempt": 0}, "num_tokens": 0, "blocks": list(blocks)},
            AdmissionRequest,
        )
    except (msgspec.ValidationError, TypeError) as exc:
        raise RoundError(f"invalid block ids: {exc}") from None
    if len(set(request.blocks)) != len(request.blocks):
        raise RoundError("a block id is named twice")
    return request.blocks


def _key(parent: ParentKey) -> tuple[str, int, int]:
    return (parent.request_id, parent.ctx_attempt, parent.gen_attempt)


def _death_cause(exc: BaseException) -> str:
    """The last line of a Ray actor death error (e.g. "RuntimeError: ..."), short."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else repr(exc))[:300]


def _actor_state(handle: Any) -> str:
    """Ray's state of an actor that has not answered yet (e.g. PENDING_CREATION:
    waiting for resources). Read from the GCS actor table, the one source that
    works without the dashboard; best effort, only for error messages."""
    try:
        from ray._private import state

        info = state.actors(handle._actor_id.hex())
        return f"Ray state {info.get('State', 'unknown')}"
    except Exception:
        return "not constructed yet"


def _kill(handle: Any) -> None:
    # Already dead or never started: nothing left to stop.
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)


#: The coordinator as a Ray async actor: ``Coordinator.remote(topology, ...)``.
Coordinator = ray.remote(num_cpus=0, max_restarts=0)(CoordinatorCore)
