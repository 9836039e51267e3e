"""`Deployment`: the client API (used by the CLI, the Ray job and the notebook).

A deployment is one CTX instance and one GEN instance of rank actors, one
coordinator per instance, and a directory where ranks find each other:

    dep = await Deployment.launch(ctx_tp=2, gen_tp=1)
    result = await dep.handoff("req-1", num_tokens=100)   # admit → ... → decode-ready
    await dep.cancel("req-2")                               # at any moment
    print(await dep.stats()); await dep.shutdown()

`SyncDeployment` wraps it for scripts (`Deployment.launch_sync(...)`).

One handoff (docs/design.md "Lifecycle") is one submission and one await:
`handoff` calls `submit` on the GEN coordinator, which admits the request in
both instances in one round (the CTX coordinator is its peer) and answers with
the decision that ends it. The ranks drive everything in between: each GEN
rank sends its OPENs when it applies the admission, the CTX round that sees
every edge prepared decides (READY, then DMA in chunks, TERMINAL, RECEIPT),
each GEN rank verifies every byte of its shard (S2), and the GEN completion
round (an intersection) makes the request decode-ready; the GEN ranks then
return the blocks (nobody consumes them here) and the CTX completion round
releases the CTX blocks exactly once. Cancellation goes to the GEN
coordinator, which cancels in both instances; every rank then drains, proves
NOT_STARTED, or quarantines (UNKNOWN), per the protocol layer.

The client's own obligations (L1, L2)
-------------------------------------
The client holds no blocks, but it is the only party that knows when a caller
stopped caring about a request, so it must hand back what the attempt holds:

- Input is checked at the API boundary (`InvalidRequest`, `InvalidConfig`)
  before any actor call: a bad request never reaches a vote, a bad topology
  never starts an actor.
- Each `handoff` runs as an *attempt* (a fresh `ParentKey`) in a task the
  deployment owns. Its submission runs in a second owned task, shielded from
  the caller, so that it is sent before any cancel of it: both go to the GEN
  coordinator from this client, and Ray keeps their order (a cancel that
  overtook its admission would leave the admitted parent behind).
- An attempt that ends other than cleanly (its `timeout` passed, its caller
  was cancelled, a newer attempt of the same request id superseded it, a rank
  or coordinator died, or anything raised) is handed to an owned *reclaim*
  task: one call that cancels the parent in both instances (the cancel round
  is applied on every rank before the coordinator answers, and a parent
  cancelled in a round can never complete in a later one; one that completed
  first gave its blocks back when it did, as the submission asked). `handoff`
  returns without waiting for it (the caller asked for a bound); the
  reclaim itself is bounded
  (`_reclaim_timeout_s`), and `shutdown()` cancels and awaits what is left
  before it kills the actors.
- `completed` means every GEN rank verified its shard and reported its bytes,
  and they add up to the request's KV size (synthetic mode; without the
  synthetic pattern nothing is verified and `bytes_verified` is 0).
- A dead rank or coordinator is an outcome ("failed"), never a Ray exception
  out of `handoff`; after `shutdown()` every call raises `DeploymentClosed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
import ray

from kvhandoff.actors._carrier import choose_carrier
from kvhandoff.actors._checks import check_request_id, check_timeout, check_tokens, short
from kvhandoff.actors._config import LaunchConfig, checked
from kvhandoff.actors._coordinator_errors import AdmissionStopped
from kvhandoff.actors._errors import (
    DeploymentClosed,
    DeploymentError,
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
)
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors._launch import Launcher
from kvhandoff.actors._metrics import record_handoff, record_hops
from kvhandoff.actors._pair import PairCore
from kvhandoff.actors._placement import remove_group
from kvhandoff.actors._submit import SubmitRequest
from kvhandoff.actors._trace import HandoffTrace, TraceRecorder, critical_path, with_events_of
from kvhandoff.protocol import AdmissionRequest, Endpoint, ParentKey, RecentMemory, Role, RoundError
from kvhandoff.topology import DEFAULT_LAYOUT as _TOPOLOGY_DEFAULT_LAYOUT
from kvhandoff.topology import InstancePlacement, TopologySpec, block_bytes, blocks_for_tokens

__all__ = ["Deployment", "SyncDeployment", "HandoffResult", "DEFAULT_LAYOUT"]

log = logging.getLogger("kvhandoff.deployment")
trace_log = logging.getLogger("kvhandoff.trace")

#: Attempt ids are U32 on the wire (ParentKey.ctx_attempt / gen_attempt).
_MAX_ATTEMPT = 2**32 - 1

T = TypeVar("T")

#: The layout of a synthetic deployment (`kvhandoff.topology.DEFAULT_LAYOUT`).
DEFAULT_LAYOUT = _TOPOLOGY_DEFAULT_LAYOUT


class HandoffResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one handoff ended as."""

    request_id: str
    outcome: str  # completed | cancelled | rejected | failed | timeout
    bytes_verified: int = 0
    latency_s: float = 0.0
    ctx_outcomes: tuple[str, ...] = ()
    gen_outcomes: tuple[str, ...] = ()
    #: The instance ids of the pair it ran between (a fleet's; "" for a `Deployment`).
    ctx_instance: str = ""
    gen_instance: str = ""


class _Attempt:
    """One `handoff` of one request id: its parent key and the owned tasks
    that drive it (`task`) and admit it (`admission`)."""

    def __init__(self, parent: ParentKey, num_tokens: int, ctx: str = "", gen: str = "") -> None:
        self.parent = parent
        self.num_tokens = num_tokens
        # The instances it pairs (a fleet has many; "": the deployment's one pair).
        self.ctx = ctx
        self.gen = gen
        self.task: asyncio.Task[HandoffResult] | None = None
        self.admission: asyncio.Task[str] | None = None  # the submission's outcome, or "broken"
        self.timeout = 60.0  # the caller's bound
        self.cancel_requested = False  # a client cancel(): a refusal is then "cancelled"
        self.abandoned = False  # superseded, or its caller stopped waiting
        # Who answers the submission, as traces name actors ("": the GEN coordinator).
        self.answered_by = ""


class Deployment(PairCore, Launcher):
    """A CTX instance and a GEN instance with their coordinators (async API)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""
        self.ctx_spec: TopologySpec
        self.gen_spec: TopologySpec
        self.layout = DEFAULT_LAYOUT
        self.qualified = True
        self.unqualified_reasons: tuple[str, ...] = ()
        self.pool_blocks = 0
        self.synthetic = True
        self._admit_at_open = False  # `launch(admit_at_open=True)`: the CTX rank admits at the OPEN
        # One placement group per instance (docs/design.md "Placement"),
        # removed by `_teardown`; `nodes` is where each instance landed.
        self._placements: dict[Role, InstancePlacement] = {}
        self._groups: dict[Role, Any] = {}
        self.nodes: dict[Role, str] = {}
        # Attempt 0 is never handed out: it is what `parent()` names for an id
        # that has no attempt (yet, or any more).
        self._attempt_ids = itertools.count(1)
        self._live: dict[str, _Attempt] = {}
        # Each request id's latest attempt (for `parent()`, `wait()`, a late
        # `cancel()`), kept `RETAIN_S` past the end of its handoff; in-flight
        # ids are in `_live`. Attempt ids come from one deployment-wide
        # counter, so forgetting an id is safe: its next attempt still gets
        # an id no rank has seen.
        self._recent: RecentMemory[str, ParentKey] = RecentMemory()
        self._reclaim_timeout_s = 60.0
        # Rank handles and CTX endpoints change only when a rank restarts (a new
        # epoch): cached, keyed by both coordinators' epochs, refreshed off the
        # critical path (concurrently with the admission rounds).
        self._view_epochs: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._view: tuple[dict[Role, list[Any]], list[Endpoint]] | None = None
        # Hop traces of sampled requests (`set_trace`, `trace`; actors/_trace.py).
        self._trace = TraceRecorder("client")
        self._export_traces = False

    # -- launch ---------------------------------------------------------------------

    @classmethod
    async def launch(
        cls, config: LaunchConfig | None = None, /, *, fault_plan: FaultPlan | None = None, **fields: Any
    ) -> Deployment:
        """Start the actors on the current Ray cluster (`ray.init()` it first, or
        let this call start a local one).

        The configuration is a `LaunchConfig` (actors/_config.py), given whole,
        as keyword fields (`launch(ctx_tp=1, gen_tp=2)`), or both (the fields
        replace the config's). `fault_plan` injects faults for tests and the
        demo's chaos (actors/_faults.py).

        Raises `InvalidConfig` naming the field for a configuration that can
        never work, before any actor starts (and before a local Ray is
        started). The start then waits on progress, not on a guess: a rank
        actor that is still starting (waiting for resources, still
        constructing) is waited for, a rank actor that died while starting
        fails the launch at once with its death cause, and `start_timeout_s`
        bounds the whole start. Any failure after the
        first actor started raises `LaunchFailed`, after killing every actor the
        launch started (directory, coordinators, their rank actors).

        `gpus_per_rank` (VRAM only) is each rank actor's share of a GPU: 1 gives
        every rank its own GPU; 0.5 lets a CTX rank and a GEN rank share one
        (Ray places them; each rank's KV pool lives on the GPU it was given).

        `control_frames` picks how OPEN, READY, TERMINAL, RECEIPT, CANCEL and
        REJECT travel between rank actors: "ray" (one-way actor calls, grouped
        per peer and event-loop turn), "nixl" (NIXL notifications
        between the ranks' agents; each rank then polls every 0.5 ms while it
        holds a live request), "stream" (a TCP connection per peer rank, read
        by the peer's event loop, no polling: actors/_stream.py; the
        default: about a third less small-handoff latency than Ray calls on
        both measured hosts) or "auto" (Ray calls or notifications, the faster per hop on this host,
        measured once at launch, actors/_carrier.py; hosts with fewer than 4
        usable cores take Ray calls without measuring). Notifications are
        much faster per hop on a many-core host, but they cost the ranks
        poll CPU, which lowers the rate of a saturated host, and Ray calls
        have the better tail on a small, busy one (docs/benchmarks.md).
        `stats()["control_frames"]` says which carrier was taken and why.

        `memory_kind` lays every rank's KV out as an engine would
        (topology/_memory.py: "blocked", "paged", "paged_hnd", "split").

        `data_mode` picks how chunks move (docs/design.md "Staged data
        plane"): "auto" (staged where an edge's pieces are small, the measured
        crossover), "direct" (one NIXL descriptor per piece) or "staged"
        (always gathered into a staging slot, one WRITE per slot, scattered
        on the GEN); `staging_window` is the slots per peer rank, each side;
        `staged_below` overrides "auto"'s crossover (bytes of average piece;
        0: the measured default for the device); `staging_slot_bytes` is one
        slot, i.e. one staged chunk (0: the device's measured default, 128 MiB
        on a GPU and `chunk_bytes` on the host; each side holds `staging_window`
        slots per peer rank); `staged_min_descriptors` is the fewest pieces
        (x blocks) an edge needs for "auto" to stage it (0: the device's
        measured default: a small request is faster direct).

        Placement (docs/design.md "Placement"): each instance gets one Ray
        placement group, one bundle per rank, STRICT_PACK (its ranks share a
        node), and its rank actors and coordinator are scheduled into it; the
        groups are removed by `shutdown()`. `placement` says where the two
        instances go: "any" (Ray picks each one's node), "pack" (both on one
        node) or "spread" (CTX and GEN on different nodes). A bundle holds
        `gpus_per_rank` GPU (VRAM) or 0.01 CPU (DRAM), plus `ctx_resources`
        / `gen_resources`, custom resources that steer an instance to the
        nodes started with them (`ray start --resources='{"ctx_node": 1}'`
        and `ctx_resources={"ctx_node": 0.01}`), and must sit on a node
        matching `ctx_labels` / `gen_labels` (a Ray label selector, for nodes
        started with `--labels`). A group not placed within
        `placement_timeout_s` raises `PlacementFailed` (a `LaunchFailed`)
        saying what was missing, and leaves no group behind; then the start
        is bounded by `start_timeout_s`.

        `admit_at_open` (the default when `ctx_tp=1`; True needs it): the
        CTX rank admits a handoff when its OPEN arrives, with no admission
        round of its own and no call from the GEN coordinator to ask it
        (docs/design.md "Admission at the OPEN"), as a `Fleet` does for its
        one-rank CTX instances. False admits in rounds on both instances."""
        cfg = checked(LaunchConfig, config, **fields)
        self = cls()
        self.name = cfg.name or f"kvh-{uuid.uuid4().hex[:8]}"
        plans = self._plan(cfg, fault_plan)
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        if cfg.memory == "VRAM" and not ray.cluster_resources().get("GPU", 0):
            raise InvalidConfig("memory='VRAM' puts each rank's KV pool on a GPU, but the Ray cluster has no GPU")
        self.carrier = await choose_carrier(cfg.control_frames)
        plans = [
            (spec, [msgspec.structs.replace(c, frames=self.carrier.carrier) for c in configs], resources)
            for spec, configs, resources in plans
        ]
        # Each rank's transfer, lease and rounds are bounded; so is handing back
        # an abandoned attempt (see the module docstring).
        self._reclaim_timeout_s = cfg.lease_timeout_s + 2 * cfg.transfer_timeout_s + 4 * cfg.round_timeout_s
        try:
            await self._place(cfg.placement, cfg.placement_timeout_s, plans)
            await self._start(plans, cfg)
        except BaseException as exc:
            await self._teardown()
            if isinstance(exc, DeploymentError) or not isinstance(exc, Exception):
                raise
            raise LaunchFailed(self.name, f"{type(exc).__name__}: {exc}") from exc
        return self

    @classmethod
    def launch_sync(cls, config: LaunchConfig | None = None, /, **kwargs: Any) -> SyncDeployment:
        """`launch` for scripts: returns a blocking wrapper with the same methods."""
        fault_plan = kwargs.pop("fault_plan", None)
        config = checked(LaunchConfig, config, **kwargs)  # before a local Ray starts
        if not ray.is_initialized():
            # Here, in the caller's thread (a script's main thread): Ray sets
            # its signal handlers only there, and warns from any other.
            ray.init(include_dashboard=False, log_to_driver=False)
        runner = _LoopThread()
        try:
            deployment = runner.run(cls.launch(config, fault_plan=fault_plan))
        except BaseException:
            runner.stop()
            raise
        return SyncDeployment(deployment, runner)

    # -- attempts -----------------------------------------------------------------------

    def coordinator(self, role: Role) -> Any:
        """The coordinator actor of one instance (rounds, stats, decision log)."""
        self._check_open()
        return self._coords[role]

    def parent(self, request_id: str) -> ParentKey:
        """The current attempt of `request_id`: the one in flight, else the most
        recent one (bounded memory), else attempt 0 (never handed out, so it
        names nothing a rank holds). Each `handoff` is a new attempt with ids
        from one deployment-wide counter, so leftovers of an earlier attempt
        (a late cancel, a stale frame) can never touch a newer one."""
        live = self._live.get(request_id)
        if live is not None:
            return live.parent
        recent = self._recent.get(request_id)
        if recent is not None:
            return recent
        return ParentKey(request_id=request_id, ctx_attempt=0, gen_attempt=0)

    def _new_attempt(self, request_id: str) -> ParentKey:
        """A fresh attempt id for `request_id`, remembered as its current one."""
        attempt = next(self._attempt_ids)
        if attempt > _MAX_ATTEMPT:
            raise DeploymentError(f"deployment {self.name!r} used up its {_MAX_ATTEMPT} attempt ids: launch a new one")
        parent = ParentKey(request_id=request_id, ctx_attempt=attempt, gen_attempt=attempt)
        self._recent.remember(request_id, parent, time.monotonic())
        return parent

    def _checked(self, request_id: Any, num_tokens: Any) -> None:
        """Refuse a request that can never succeed, before any actor call."""
        check_request_id(request_id)
        check_tokens(num_tokens, self.layout, self.pool_blocks)

    # -- the client API ------------------------------------------------------------------

    async def refresh_view(self) -> None:
        """Re-read rank handles and CTX endpoints if any rank restarted since."""
        ctx_epochs, gen_epochs = await asyncio.gather(
            self._coords[Role.CTX].epochs.remote(), self._coords[Role.GEN].epochs.remote()
        )
        epochs = (tuple(ctx_epochs), tuple(gen_epochs))
        if epochs == self._view_epochs:
            return
        # The directory may lag a restart by a moment: wait until it caught up,
        # rather than hand GEN a dead incarnation's endpoint.
        await self._directory.wait_for.remote(
            {self.ctx_spec.instance_id: ctx_epochs, self.gen_spec.instance_id: gen_epochs}, 30.0
        )
        ctx_handles, gen_handles, entries = await asyncio.gather(
            self._coords[Role.CTX].rank_handles.remote(),
            self._coords[Role.GEN].rank_handles.remote(),
            self._directory.all_of.remote(Role.CTX.value),
        )
        self._view = ({Role.CTX: list(ctx_handles), Role.GEN: list(gen_handles)}, [e[0] for e, _ in entries])
        self._view_epochs = epochs

    async def ranks(self, role: Role) -> list[Any]:
        """The current rank actor handles of one instance (rank i at index i)."""
        self._check_open()
        await self.refresh_view()
        return self._cached_ranks(role)

    def _cached_ranks(self, role: Role) -> list[Any]:
        assert self._view is not None, "refresh_view() first"
        return list(self._view[0][role])

    async def _all_ranks(self) -> list[Any]:
        await self.refresh_view()
        return [*self._cached_ranks(Role.CTX), *self._cached_ranks(Role.GEN)]

    async def ctx_endpoints(self) -> list[Endpoint]:
        """The current CTX endpoints."""
        self._check_open()
        await self.refresh_view()
        assert self._view is not None
        return list(self._view[1])

    async def wait(self, request_id: str, role: Role, timeout: float) -> list[str]:
        """Every rank's local outcome of the current attempt of `request_id`
        ("died" for a rank that could not answer), waiting at most `timeout`."""
        self._check_open()
        return await self._wait(self.parent(request_id), role, timeout)

    async def _wait(self, parent: ParentKey, role: Role, timeout: float, absent: str | None = None) -> list[str]:
        handles = self._cached_ranks(role) if self._view is not None else await self.ranks(role)
        return await self._wait_on(handles, parent, timeout, absent)

    async def _wait_on(self, handles: list[Any], parent: ParentKey, timeout: float, absent: str | None = None) -> list[str]:
        found = await asyncio.gather(
            *(h.wait.remote(parent, timeout, absent) for h in handles), return_exceptions=True
        )
        # A rank that died mid-request is an outcome (the request failed), not an error.
        return [o if isinstance(o, str) else "died" for o in found]

    async def handoff(self, request_id: str, num_tokens: int, *, timeout: float = 60.0) -> HandoffResult:
        """Run one request end to end; returns its outcome.

        One submission and one await: the GEN coordinator admits the request
        in both instances, the ranks drive it (OPEN, decide, READY, DMA,
        TERMINAL, verify, decode-ready) and the decision that ends it answers
        this call; nothing is polled. Every GEN rank returns the blocks once
        it verified them (nobody else consumes them here).

        Outcomes: "completed" (every GEN rank verified its shard; the
        completion round needs every one of them, and `bytes_verified` is the
        request's whole KV size), "cancelled" (a `cancel()`, or a newer
        `handoff` of the same request id superseded this one), "rejected"
        (admission refused: no blocks, a rank restarting, or no protocol
        version and capabilities agreed between the ranks), "failed" (a
        rank or coordinator died, bytes did not verify), "timeout" (`timeout`
        seconds passed). Whatever the attempt still held is handed back by a
        task the deployment owns (module docstring), also when the caller is
        cancelled while waiting here.

        Raises only `InvalidRequest` (bad arguments: nothing was sent) and
        `DeploymentClosed` (after `shutdown()`)."""
        self._check_open()
        check_timeout(timeout)
        self._checked(request_id, num_tokens)
        return await self._handoff(request_id, num_tokens, float(timeout))

    async def _handoff(self, request_id: str, num_tokens: int, timeout: float, ctx: str = "", gen: str = "") -> HandoffResult:
        """`handoff` once its arguments were checked (a fleet also names the pair)."""
        older = self._live.get(request_id)
        if older is not None:
            # Superseded: the older attempt ends "cancelled" and is handed back.
            older.abandoned = True
            assert older.task is not None
            older.task.cancel()
        attempt = _Attempt(self._new_attempt(request_id), num_tokens, ctx, gen)
        attempt.timeout = timeout
        self._live[request_id] = attempt
        # The submission starts now, in its own task: whoever hands the attempt
        # back waits for it to be sent first (see the module docstring).
        attempt.admission = self._spawn(self._submit(attempt))
        attempt.task = self._spawn(self._run(attempt, timeout))
        try:
            return await asyncio.shield(attempt.task)
        except asyncio.CancelledError:
            if attempt.task.cancelled():  # shutdown() cancelled it, not our caller
                raise DeploymentClosed(self.name) from None
            # Our caller gave up: end the attempt; its task hands everything back.
            attempt.abandoned = True
            attempt.task.cancel()
            raise

    async def _submit(self, attempt: _Attempt) -> str:
        """The one submission: the GEN coordinator's answer, or "broken" when
        it could not be asked (it died)."""
        self.calls["submit"] += 1
        request_id = attempt.parent.request_id
        self._trace.record(request_id, "submit", "local")
        try:
            outcome = str(await self._submit_call(attempt))
            source = attempt.answered_by or f"coord@{attempt.gen or self.gen_spec.instance_id}"
            self._trace.record(request_id, "outcome", "reply", source)
            return outcome
        except AdmissionStopped:  # draining (a fleet's instance): refused before anything was queued
            return "rejected"
        except Exception as exc:
            log.warning("%s: submitting %s raised: %r", self.name, attempt.parent, exc)
            return "broken"

    def _submit_call(self, attempt: _Attempt) -> Any:
        """The submission (a fleet names the CTX instance too); a lone handoff
        between instances of one rank each goes to the GEN rank by Ray call,
        unless the client's channel to the GEN coordinator is open: a message
        on it, the coordinator's admission alone and its answer on it cost
        less than one Ray call."""
        coordinator = self._coords[Role.GEN]
        if self._receives_at_rank() and len(self._live) == 1 and not self._submitter.has_channel(coordinator):
            return self._at_rank(attempt)
        return self._submitter.submit(coordinator, SubmitRequest(attempt.parent, attempt.num_tokens, True))

    def _receives_at_rank(self) -> bool:
        """Instances of one rank each, the CTX admitting at the OPEN: the GEN
        rank is its instance's whole intersection and its OPEN the admission."""
        return self._admit_at_open and self.ctx_spec.tp == 1 and self.gen_spec.tp == 1

    async def _at_rank(self, attempt: _Attempt) -> str:
        """One handoff as one call to the GEN rank (`receive_alone`): it
        admits, sends the OPEN, completes alone and answers; no coordinator
        on the path (its coordinator learns of it from the rank's report).
        Only while this client has no other handoff live: under load the
        coordinator's rounds batch admissions and their OPENs, where a call
        per handoff costs more (docs/design.md "Admission at the OPEN")."""
        self.calls["receive_at_rank"] += 1
        if self._view_epochs is None:
            await self.refresh_view()
        rank = self._cached_ranks(Role.GEN)[0]
        request = AdmissionRequest(attempt.parent, attempt.num_tokens, release_when_ready=True)
        try:
            outcome, _ = await rank.receive_alone.remote(request, attempt.timeout)
            # The rank answered: a trace's last hop comes from it, not from
            # its coordinator (whose lazy report may arrive first).
            attempt.answered_by = f"rank0@{self.gen_spec.instance_id}"
        except RoundError:
            # Refused before anything was held (an incarnation not joined
            # yet: a restart under way): its coordinator answers instead.
            self._view_epochs = None
            return await self._submitter.submit(
                self._coords[Role.GEN], SubmitRequest(attempt.parent, attempt.num_tokens, True)
            )
        except Exception:
            self._view_epochs = None  # the rank died, perhaps: read the view again next time
            raise
        return str(outcome)

    async def _attempt_ranks(self, attempt: _Attempt, role: Role) -> list[Any]:
        """The current rank handles of the attempt's instance of `role`."""
        await self.refresh_view()
        return self._cached_ranks(role)

    async def _run(self, attempt: _Attempt, timeout: float) -> HandoffResult:
        """Drive one attempt under its `timeout`; whatever way it ends, an
        attempt that did not end cleanly is handed to `_reclaim`."""
        parent = attempt.parent
        start = time.perf_counter()
        result: HandoffResult | None = None
        clean = False
        try:
            async with asyncio.timeout(timeout):
                result, clean = await self._drive(attempt, timeout, start)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            if self._closed or not attempt.abandoned:
                raise
        except Exception as exc:  # a coordinator died, a Ray call failed: an outcome
            log.warning("%s: handoff %s failed: %r", self.name, parent, exc)
            result = HandoffResult(request_id=parent.request_id, outcome="failed")
        finally:
            if self._live.get(parent.request_id) is attempt:
                del self._live[parent.request_id]
                if self._recent.get(parent.request_id) == parent:
                    self._recent.remember(parent.request_id, parent, time.monotonic())
        latency = time.perf_counter() - start
        if result is None:
            outcome = "cancelled" if attempt.abandoned else "timeout"
            result = HandoffResult(request_id=parent.request_id, outcome=outcome, latency_s=latency)
        if not clean:
            self._spawn(self._reclaim(attempt))
        record_handoff(self.name, result.outcome, result.latency_s or latency)
        if self._export_traces and self._trace.on(parent.request_id):
            self._spawn(self._export_trace(parent.request_id, result.outcome))
        return result

    async def _export_trace(self, request_id: str, outcome: str) -> None:
        """One sampled handoff's trace as a log line and a metric (`set_trace`)."""
        try:
            trace = await self.trace(request_id)
        except Exception as exc:  # shut down meanwhile, or an actor died: nothing to export
            log.debug("%s: trace of %s not read: %r", self.name, request_id, exc)
            return
        if trace is None:
            return
        record_hops(self.name, outcome, trace.hops)
        steps = " > ".join(f"{h.actor}:{h.what}+{h.since_prev_ms:.2f}ms" for h in trace.path)
        trace_log.info(
            "%s %s %s: %d hops, %.2f ms: %s", self.name, request_id, outcome, trace.hops, trace.total_ms, steps
        )

    async def _drive(self, attempt: _Attempt, timeout: float, start: float) -> tuple[HandoffResult, bool]:
        """Await the submission's outcome; returns the result and whether it
        ended cleanly (nothing left for `_reclaim` to hand back)."""
        parent = attempt.parent
        request_id = parent.request_id
        assert attempt.admission is not None
        decided = await asyncio.shield(attempt.admission)
        latency = time.perf_counter() - start
        if decided == "completed":
            verified = self._expected_bytes(attempt.num_tokens) if self.synthetic else 0
            result = HandoffResult(
                request_id=request_id,
                outcome="completed",
                bytes_verified=verified,
                latency_s=latency,
                gen_outcomes=("completed",) * self._gen_tp(attempt),
            )
            return result, True
        if decided == "rejected":
            outcome = "cancelled" if attempt.cancel_requested else "rejected"
            return HandoffResult(request_id=request_id, outcome=outcome, latency_s=latency), True
        if decided == "broken":
            return HandoffResult(request_id=request_id, outcome="failed", latency_s=latency), False
        # Cancelled or failed: what each rank made of it (released, drained,
        # quarantined) is the outcome's detail; wait for it within the bound.
        gen_ranks, ctx_ranks = await asyncio.gather(
            self._attempt_ranks(attempt, Role.GEN), self._attempt_ranks(attempt, Role.CTX)
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout - (time.perf_counter() - start)
        # Both instances decided it by now (the GEN decision waited for the
        # CTX admission's answer): a rank that never held it never will.
        gen, ctx = await asyncio.gather(
            self._wait_on(gen_ranks, parent, max(deadline - loop.time(), 0.0), absent="none"),
            self._wait_on(ctx_ranks, parent, max(deadline - loop.time(), 0.0), absent="none"),
        )
        outcome = _overall(gen, ctx) if decided == "cancelled" else "failed"
        if outcome == "rejected" and attempt.cancel_requested:
            outcome = "cancelled"  # as for a refusal in a round: the client asked to end it
        result = HandoffResult(
            request_id=request_id,
            outcome=outcome,
            latency_s=latency,
            ctx_outcomes=tuple(ctx),
            gen_outcomes=tuple(gen),
        )
        return result, outcome in ("cancelled", "rejected")

    def _gen_tp(self, attempt: _Attempt) -> int:
        return self.gen_spec.tp

    def _spec(self, role: Role) -> TopologySpec:
        return self.ctx_spec if role is Role.CTX else self.gen_spec

    def _expected_bytes(self, num_tokens: int) -> int:
        """The request's whole KV on the GEN side: every GEN rank's shard."""
        tp = self.gen_spec.tp
        return blocks_for_tokens(self.layout, num_tokens) * block_bytes(self.layout, tp) * tp

    async def _reclaim(self, attempt: _Attempt) -> None:
        """Hand back everything an attempt that did not end cleanly may hold
        (bounded by `_reclaim_timeout_s`; owned, cancelled by shutdown()).

        One call: a cancel to the GEN coordinator, which cancels in both
        instances (sent after the submission, so it cannot overtake its
        admission; applied on every rank before the coordinator answers; once
        cancelled, the parent can never complete later). Nothing needs a free
        after it: the submission asked the GEN ranks to return the blocks
        once verified (`release_when_ready`), so a parent that completed
        before the cancel gave its blocks back at its completion's apply."""
        parent = attempt.parent
        try:
            async with asyncio.timeout(self._reclaim_timeout_s):
                # The cancel goes after the submission (same caller, same
                # coordinator: Ray keeps their order), so it cannot overtake it.
                await self._cancel_parent(parent, attempt)
        except TimeoutError:
            log.warning("%s: handing back %s took over %gs", self.name, parent, self._reclaim_timeout_s)
        except Exception as exc:
            log.warning("%s: handing back %s failed: %r", self.name, parent, exc)

    async def cancel(self, request_id: str) -> None:
        """Cancel a request at any moment: both instances decide it in their next round."""
        self._check_open()
        check_request_id(request_id)
        live = self._live.get(request_id)
        if live is not None:
            await self._cancel(live)
        else:
            await self._cancel_parent(self.parent(request_id))

    async def _cancel(self, attempt: _Attempt) -> None:
        attempt.cancel_requested = True
        await self._cancel_parent(attempt.parent, attempt)

    async def set_trace(self, every: int, export: bool = False) -> None:
        """Trace one request in `every` from now on (0: off; 1: every one):
        this client, every coordinator and every rank record when each
        message about a sampled request reached them (a hash of the request
        id samples it, so every actor agrees). Read a trace with `trace`;
        with `export`, the deployment reads each sampled handoff's trace as
        it ends, logs it as one line (logger ``kvhandoff.trace``) and records
        its hops (metric ``kvhandoff_handoff_hops``); `trace` then finds none."""
        self._check_open()
        if not isinstance(export, bool):
            raise InvalidRequest(f"export must be a bool, got {short(export)}")
        self._trace.set_every(every)
        self._export_traces = export
        await asyncio.gather(*(c.set_trace.remote(every, peer) for c, peer in self._trace_coordinators()))

    async def trace(self, request_id: str) -> HandoffTrace | None:
        """The hop trace of a finished, sampled request: every event of every
        actor in time order and the critical path through them (its hops,
        each with its carrier and the time since the step before). The events
        are taken: a second call returns None, as does a request not sampled."""
        self._check_open()
        check_request_id(request_id)
        calls = (c.trace_events.remote(request_id) for c, _ in self._trace_coordinators())
        events = await with_events_of(self._trace.take(request_id), calls)
        return critical_path(request_id, events) if events else None

    def _trace_coordinators(self) -> list[tuple[Any, str]]:
        """Every coordinator, with the instance it pairs with by default."""
        return [
            (self._coords[Role.CTX], self.gen_spec.instance_id),
            (self._coords[Role.GEN], self.ctx_spec.instance_id),
        ]

    def _stats_head(self) -> dict[str, Any]:
        return {"name": self.name, "qualified": self.qualified, "unqualified_reasons": list(self.unqualified_reasons)}

    def _known_ranks(self, role: Role) -> list[Any]:
        return self._view[0][role] if self._view is not None else []

    async def _teardown(self) -> None:
        """Kill every actor this deployment started (killing a coordinator
        also ends its ranks: Ray ends the actors an actor owns)."""
        await super()._teardown()
        # Last: removing a group also ends any actor still scheduled in it.
        for role in list(self._groups):
            with contextlib.suppress(Exception):
                remove_group(self._groups.pop(role))


def _overall(gen: list[str], ctx: list[str]) -> str:
    """The outcome of a handoff that did not complete, from every rank's local outcome."""
    every = set(gen) | set(ctx)
    if {"quarantined", "failed", "died"} & every:
        return "failed"
    if "timeout" in every:
        return "timeout"
    if "rejected" in every and not ({"cancelled", "released"} & every):
        return "rejected"
    return "cancelled"


class _LoopThread:
    """An event loop in a daemon thread, for the synchronous wrapper."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kvhandoff-loop")
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        """Stop the loop, wait for its thread, cancel what is left on it and
        close it: nothing of the deployment (no task awaiting a Ray reference)
        outlives this call. Idempotent."""
        if self.loop.is_closed():
            return
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
        left = asyncio.all_tasks(self.loop)
        for task in left:
            task.cancel()
        if left:
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.loop.close()


class SyncDeployment:
    """Blocking wrapper around `Deployment` for scripts and Ray jobs."""

    def __init__(self, deployment: Deployment, runner: _LoopThread) -> None:
        self.deployment = deployment
        self._runner = runner

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.deployment.closed:  # the loop is stopped: running anything would hang
            coro.close()
            raise DeploymentClosed(self.deployment.name)
        return self._runner.run(coro)

    def handoff(self, request_id: str, num_tokens: int, **kw: Any) -> HandoffResult:
        return self._run(self.deployment.handoff(request_id, num_tokens, **kw))

    def cancel(self, request_id: str) -> None:
        self._run(self.deployment.cancel(request_id))

    def stats(self) -> dict[str, Any]:
        return self._run(self.deployment.stats())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run any coroutine (e.g. a workload) on the deployment's loop."""
        return self._run(coro)

    def shutdown(self) -> None:
        """Idempotent, like `Deployment.shutdown`; its loop thread ends too."""
        if not self.deployment.closed:
            self._runner.run(self.deployment.shutdown())
        self._runner.stop()
