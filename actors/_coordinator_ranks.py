"""The coordinator's rank lifecycle (part of `CoordinatorCore`,
actors/_coordinator.py): the ranks' first start, watching them, the fail
policy and its restarts, planned restarts (`request_restart`), re-attached
incarnations (`replace_rank`), and failing what is pending when the topology
stops. `CoordinatorCore` inherits it as `RanksMixin`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError

from kvhandoff.actors._coordinator_errors import (
    AdmissionStopped,
    CoordinatorError,
    TopologyFailed,
    TopologyState,
)
from kvhandoff.actors._coordinator_state import CoordinatorState
from kvhandoff.protocol import RoundError

RankFactory = Callable[[int, int], Any]  # (rank, epoch) -> ActorHandle


class RanksMixin(CoordinatorState):
    """The rank lifecycle of `CoordinatorCore`: it owns the state declared here."""

    _rank_factory: RankFactory | None
    _max_restarts: int
    _restart_timeout: float
    _restart_attempts: int
    _restart_backoff: float
    _restart_failures: int
    _restarts: int
    _reclaim_restarts: int
    _reclaimed_by_restart: int
    _reattach_directory: str | None
    _reattached: int
    _draining: bool
    _failure_reason: str
    _start_status: dict[int, str]

    if TYPE_CHECKING:  # CoordinatorCore's, and the rounds'
        async def _ensure_started(self) -> None: ...
        def _raise_if_unusable(self) -> None: ...
        def _take_epoch(self) -> int: ...
        def _own(self, coro: Any) -> None: ...
        async def _rank_set_trace(self, handle: Any) -> None: ...
        def _flush_carry(self) -> None: ...

    # -- the ranks' first start -------------------------------------------------------

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
                    if (self._admits_at_open or self._admits_alone) and self._draining:
                        await handle.close_admission.remote()  # joined into a drain: it admits nothing
            except Exception as exc:
                self._restart_failures += 1
                self._rank_errors.append(f"restart rank {rank} epoch {epoch}: {exc!r}"[:500])
                if handle is not None:
                    _kill(handle)
                continue
            self._seat(rank, epoch, handle)
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
            if (self._admits_at_open or self._admits_alone) and self._draining:
                await handle.close_admission.remote()  # re-attached into a drain: it admits nothing
            self._seat(rank, epoch, handle)
            self._detached.discard(rank)
            self._metrics.restarted("reattach")
            self._reattached += 1
            if not self._detached:
                self.state = self._serving_state()
                self._failure_reason = ""
        self._wakeup.set()
        return epoch

    def _seat(self, rank: int, epoch: int, handle: Any) -> None:
        """Incarnation ``epoch`` of ``rank`` (``handle``, joined at the next
        round) is the rank from here on: the leader counts its votes, its death
        is watched, and it traces when this coordinator does."""
        assert self._leader is not None
        self._leader.set_epoch(rank, epoch)
        self._epochs[rank] = epoch
        self._handles[rank] = handle
        self._watch_rank(rank)
        if self.trace.every:
            self._own(self._rank_set_trace(handle))

    def _watch_rank(self, rank: int) -> None:
        """Learn of rank `rank`'s death at once: its `watch` never answers
        while it lives. A death makes the next round a vote round, which
        finds it and runs the fail policy (as a missed deadline would, only
        without waiting for the next round to happen)."""
        handle, epoch = self._handles[rank], self._epochs[rank]
        self._links.open(rank, handle)  # its round calls go over it once open

        async def watch() -> None:
            try:
                await handle.watch.remote()
            except ActorDiedError:
                self._links.drop(rank, handle)  # calls waiting on it fail now, as Ray's would
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
        for parent, (_, future) in admits.items():
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
