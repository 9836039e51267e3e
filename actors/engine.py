"""`EngineDeployment`: kvhandoff embedded in a serving engine.

Theory of operation (docs/design.md "Engines")
----------------------------------------------
The engine owns three things kvhandoff must never take from it: its KV
tensors (in its workers, next to the model), its block manager (one block
table per instance: the same block ids on every TP rank) and its compute
(prefill runs in the engine). kvhandoff owns the handoff between them:

1. **Create.** `EngineDeployment.create(...)` checks the configuration and
   starts the directory; its `plan` (an `EnginePlan`) goes to the engine's
   workers.
2. **Host.** Each worker (a Ray actor of the engine's, an `EndpointHost`)
   builds its rank endpoint over its own tensors: ``self.kvhandoff =
   ctx_endpoint(plan, rank, tensors)`` (or `gen_endpoint`). The tensors are
   registered with NIXL once, there.
3. **Attach.** `attach(ctx_workers, gen_workers)` starts one coordinator per
   instance over those actors and waits until every endpoint registered and
   knows its peers.
4. **Publish (prefill side).** After prefill wrote the request's KV into
   blocks its block manager chose, the prefill server calls
   `publish(request_id, num_tokens, blocks)`: one admission round in which
   every CTX rank leases exactly those block ids (its pool mirrors the
   engine's), under a lease deadline. It returns a `HandoffTicket`; its
   string form crosses the front end's HTTP hop. Each publish is a new
   attempt: a retry of the request id publishes again and gets a new ticket,
   and frames of the old attempt are stale.
5. **Receive (decode side).** The decode server allocates destination blocks
   from its own block manager and calls `receive(ticket, blocks)`: one
   submission to the GEN coordinator, which admits the blocks on every GEN
   rank and *claims* the published parent on the CTX instance in the same
   round (a ticket is claimed once). When both instances have one rank, the
   GEN rank admits alone, in one call, and its OPEN is the claim: the CTX
   rank binds the parent to the first GEN OPEN and refuses any other (the
   claim that names the GEN instance to the CTX coordinator, for cancels,
   goes beside it). The ranks then drive the transfer as in every handoff. `receive` answers `completed` when every byte landed and
   was accounted for on every GEN rank (decode-ready); the GEN ranks then
   give the blocks back to the engine, and `receive` returns only once they
   have (`blocks_returned`). Any other outcome (`cancelled`, `rejected`,
   `failed`, `timeout`) means the engine must not decode from the blocks;
   they are back only when `blocks_returned` is True (quarantined blocks are
   not: `returned(ticket, Role.GEN)` waits for their reclaim).
   `start_receive` is the same receive for a caller on the GEN rank's own
   loop (an engine's decode worker hosts it): a pulled receive whose READ
   ends at once ends within that call, with no turn of the loop.
6. **Reuse (prefill side).** The prefill server reuses the published blocks
   only after `returned(ticket, Role.CTX)` answered True: every CTX rank
   released them, which happens once S1 is proven (the transfer completed,
   or was cancelled and drained or never started) or, for quarantined ones,
   after a reclaim with a proof of quiescence.
7. **Cancel** at any moment, from either side: `cancel(ticket)` is one
   call, to the GEN coordinator, which cancels in both instances (a
   published ticket nobody claimed too; its lease deadline ends it as
   well). Only if the GEN coordinator cannot be asked is the CTX one asked
   directly (actors/_pair.py).

A front end in another process uses `EngineDeployment.connect(plan)`: the
coordinators are named actors. Nothing here holds blocks: every block is held
by an endpoint, under the protocol's rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import ray

from kvhandoff.actors import _checks as checks
from kvhandoff.actors._carrier import choose_carrier
from kvhandoff.actors._config import EngineConfig, staging_of
from kvhandoff.actors._config import checked as checks_config
from kvhandoff.actors._coordinator_errors import AdmissionStopped, ParentInFlight
from kvhandoff.actors._directory import Directory
from kvhandoff.actors._errors import (
    DeploymentError,
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
    StaleTicket,
)
from kvhandoff.actors._instance import _ref, await_started, connected, start_coordinator
from kvhandoff.actors._metrics import record_handoff
from kvhandoff.actors._pair import PairCore
from kvhandoff.actors._submit import SubmitRequest
from kvhandoff.actors.endpoint import EnginePlan
from kvhandoff.actors.rank import CtxRankCore, GenRankCore
from kvhandoff.actors.rank._host import hosted_here
from kvhandoff.protocol import (
    AdmissionRequest,
    HandoffTicket,
    Lend,
    MemoryKind,
    ParentKey,
    Role,
    TopologyError,
)
from kvhandoff.topology import (
    TopologySpec,
    check_memory_kind,
    qualify_pair,
    shard_map,
    topology_digest,
)

__all__ = ["EngineDeployment", "EngineResult", "PublishRefused", "StaleTicket"]

log = logging.getLogger("kvhandoff.engine")


class PublishRefused(DeploymentError):
    """`publish` was refused by the CTX instance: a block id that is out of
    range or still held by kvhandoff for another request (the engine's block
    manager and kvhandoff's pool mirror disagree), a rank that stopped
    admitting (quarantine limit), or no protocol agreed. Nothing is held."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"publish of {request_id!r} refused: {reason}")
        self.request_id = request_id
        self.reason = reason


class EngineResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one `receive` ended.

    ``outcome``: "completed" (decode-ready: every byte of the request's KV
    landed in the engine's blocks on every GEN rank and was accounted for),
    "cancelled", "rejected" (not admitted: the ticket was stale, cancelled,
    claimed already or expired, or a GEN block was not free),
    "failed", "timeout". Whatever the outcome but "completed", the engine
    must not decode from the blocks.
    ``blocks_returned``: kvhandoff holds none of the request's GEN blocks any
    more (always True after "completed"); when False (quarantined: a write
    could not be proven finished) the engine must not reuse them until
    `returned(ticket, Role.GEN)` says so."""

    request_id: str
    outcome: str
    blocks_returned: bool
    latency_s: float = 0.0


def refused_duplicate(name: str, parent: ParentKey, start: float) -> EngineResult:
    """A receive of a ticket whose receive is still under way: refused by
    the GEN coordinator before anything was leased for it. Nothing of this
    receive is held (its blocks are the engine's), and the receive under
    way goes on: it is not cancelled."""
    latency = time.perf_counter() - start
    record_handoff(name, "rejected", latency)
    return EngineResult(request_id=parent.request_id, outcome="rejected", blocks_returned=True, latency_s=latency)


class EngineDeployment(PairCore):
    """The control side of an engine deployment (module docstring)."""

    _kills_ranks = False  # the engine's workers are the engine's

    def __init__(self, plan: EnginePlan) -> None:
        super().__init__()
        self.plan = plan
        self.name = plan.name
        self._ctx_digest = topology_digest(plan.ctx)
        self._ranks: dict[Role, list[Any]] = {}
        self._owns = False  # started the directory and coordinators (shutdown kills them)
        self._round_timeout_s = 5.0

    # -- set-up ---------------------------------------------------------------------

    @classmethod
    async def create(cls, config: EngineConfig | None = None, /, **fields: Any) -> EngineDeployment:
        """Check the configuration (an `EngineConfig`, its fields as keywords,
        or both: `InvalidConfig` naming the field, before anything starts) and
        start the directory; `plan` is then ready for the engine's workers.

        ``ctx_memory`` / ``gen_memory`` name how each side's tensors hold the
        blocks ("blocked", "paged", "paged_hnd", "split": docs/design.md
        "Memory kinds"); ``memory`` is where they live ("DRAM" or "VRAM").
        ``data_mode`` / ``staging_window`` / ``staged_below`` /
        ``staging_slot_bytes`` / ``staged_min_descriptors`` pick the data
        plane as in `Deployment.launch` (docs/design.md "Data plane"): paged
        layouts move many small pieces, which "auto" stages."""
        cfg = checks_config(EngineConfig, config, **fields)
        layout, ctx_tp, gen_tp = cfg.layout, cfg.ctx_tp, cfg.gen_tp
        name = cfg.name or f"kvh-{uuid.uuid4().hex[:8]}"
        try:
            mem = MemoryKind(cfg.memory)
            check_memory_kind(cfg.ctx_memory)
            check_memory_kind(cfg.gen_memory)
            common = {"memory": mem, "transfer_timeout_s": cfg.transfer_timeout_s}
            ctx = TopologySpec(instance_id=f"{name}-ctx", role=Role.CTX, tp=ctx_tp, **common)
            gen = TopologySpec(instance_id=f"{name}-gen", role=Role.GEN, tp=gen_tp, **common)
            shard_map(layout, ctx_tp, gen_tp)
        except (TopologyError, TypeError, ValueError) as exc:
            raise InvalidConfig(str(exc)) from exc
        verdict = qualify_pair(ctx, gen)
        if not verdict.qualified:
            # Engines hand off under cancellation: outside the qualified scope
            # the active cancel protocol is off, which an engine must choose
            # knowingly (Deployment.launch runs it conservatively).
            raise InvalidConfig(f"outside the qualified scope: {'; '.join(verdict.reasons)}")
        plan = EnginePlan(
            name=name,
            ctx=ctx,
            gen=gen,
            layout=layout,
            ctx_memory=cfg.ctx_memory,
            gen_memory=cfg.gen_memory,
            chunk_bytes=cfg.chunk_bytes,
            lease_timeout_s=cfg.lease_timeout_s,
            control_frames=cfg.control_frames,
            pull=cfg.pull and ctx_tp == 1 and gen_tp == 1,
            read_spin_s=cfg.read_spin_s,
            **staging_of(cfg),
        )
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        carrier = await choose_carrier(cfg.control_frames)
        self = cls(msgspec.structs.replace(plan, control_frames=carrier.carrier))
        self.carrier = carrier
        self._round_timeout_s = cfg.round_timeout_s
        self._owns = True
        self._directory = Directory.options(name=f"{name}.directory").remote()
        await self._directory.descriptors.remote()  # up before any endpoint registers
        return self

    async def attach(
        self, ctx_workers: Sequence[Any], gen_workers: Sequence[Any], *, start_timeout_s: float = 600.0
    ) -> None:
        """Start one coordinator per instance over the engine's worker actors
        (rank r of each instance is the r-th handle; each hosts its endpoint,
        built from `plan`), then wait until every endpoint registered and
        learned its peers. Raises `LaunchFailed` (and stops what it started)
        if a worker does not answer as the rank it should be within
        `start_timeout_s`."""
        self._check_open()
        plan = self.plan
        for role, workers in ((Role.CTX, ctx_workers), (Role.GEN, gen_workers)):
            if len(workers) != plan.spec(role).tp:
                raise InvalidConfig(f"{role.value} instance has tp={plan.spec(role).tp}, got {len(workers)} workers")
        self._ranks = {Role.CTX: list(ctx_workers), Role.GEN: list(gen_workers)}
        try:
            for role, workers in self._ranks.items():
                self._coords[role] = start_coordinator(
                    f"{plan.name}.coord.{role.value}",
                    plan.spec(role),
                    workers,
                    round_timeout=self._round_timeout_s,
                    max_restarts=0,
                    peer=f"{plan.name}.coord.{Role.CTX.value}" if role is Role.GEN else None,
                    peer_claims=role is Role.GEN,
                    # One GEN rank claims a ticket of one CTX rank with no
                    # round; between ranks alone both sides admit alone.
                    admits_alone=(role is Role.GEN and plan.gen.tp == 1) or (role is Role.CTX and self._at_rank),
                    # A failed worker is detached, not fatal: the engine re-attaches it (`reattach`).
                    reattach=f"{plan.name}.directory",
                    client_channels=plan.control_frames == "stream",
                )
            await await_started(
                plan.name,
                {role.value: c for role, c in self._coords.items()},
                {role.value: plan.spec(role).instance_id for role in self._coords},
                self._directory,
                start_timeout_s,
            )
            await connected(plan.name, [h for hs in self._ranks.values() for h in hs], start_timeout_s)
        except BaseException as exc:
            await self._teardown()
            if isinstance(exc, DeploymentError) or not isinstance(exc, Exception):
                raise
            raise LaunchFailed(plan.name, f"{type(exc).__name__}: {exc}") from exc

    @classmethod
    async def connect(cls, plan: EnginePlan) -> EngineDeployment:
        """The same deployment, from another process (a front end): finds
        its named coordinators. `shutdown` of this handle stops nothing."""
        self = cls(plan)
        for role in (Role.CTX, Role.GEN):
            self._coords[role] = ray.get_actor(f"{plan.name}.coord.{role.value}")
            self._ranks[role] = list(await self._coords[role].rank_handles.remote())
        return self

    # -- the prefill side -----------------------------------------------------------

    async def publish(self, request_id: str, num_tokens: int, blocks: Sequence[int]) -> HandoffTicket:
        """Offer a prefilled request's KV for handoff (module docstring, step 4).

        ``blocks`` are the engine's block ids holding the request's
        ``num_tokens`` tokens, in order (the same ids on every CTX rank).
        Returns the ticket; raises `InvalidRequest` (bad arguments: nothing
        was sent) or `PublishRefused` (a rank refused: nothing is held)."""
        self._check_open()
        parent = checks.fresh_parent(request_id)
        ids = checks.check_blocks(num_tokens, blocks, self.plan.layout)
        if self._at_rank:
            # Between instances of one rank each the CTX rank leases the
            # blocks alone (`publish_alone`): no admission round on the
            # prefill engine's path. The GEN rank's OPEN is the claim.
            try:
                ok = await self._publish_at_rank(AdmissionRequest(parent, num_tokens, blocks=ids))
            except Exception as exc:  # the rank died or restarts: the engine re-attaches it
                raise PublishRefused(request_id, f"the CTX rank admits nothing now: {exc!r}"[:500]) from None
        else:
            try:
                ok = await self._coords[Role.CTX].admit.remote(parent, num_tokens, ids)
            except AdmissionStopped as exc:  # a worker is detached (re-attach it) or a rank restarting
                raise PublishRefused(request_id, f"the CTX instance admits nothing now: {exc.reason}") from None
        if ok is False:
            raise PublishRefused(request_id, "a CTX rank refused the blocks (see its stats' counters)")
        return HandoffTicket(
            deployment=self.plan.name,
            request_id=parent.request_id,
            ctx_attempt=parent.ctx_attempt,
            gen_attempt=parent.gen_attempt,
            ctx_instance=self.plan.ctx.instance_id,
            ctx_digest=self._ctx_digest,
            num_tokens=num_tokens,
            lend=ok if isinstance(ok, Lend) else None,  # pull: the GEN rank READs the lent blocks
        )

    # -- the decode side --------------------------------------------------------------

    async def receive(
        self, ticket: HandoffTicket | str, blocks: Sequence[int], *, timeout: float = 60.0
    ) -> EngineResult:
        """Move a published request's KV into the engine's GEN ``blocks``
        (module docstring, step 5). ``ticket`` is the `HandoffTicket` or its
        string form. Raises only `InvalidRequest` / `TicketError` /
        `StaleTicket` (nothing was sent) and `DeploymentClosed`; every other
        ending is an outcome."""
        started = self.start_receive(ticket, blocks, timeout=timeout)
        return started if isinstance(started, EngineResult) else await started

    def start_receive(
        self, ticket: HandoffTicket | str, blocks: Sequence[int], *, timeout: float = 60.0
    ) -> EngineResult | asyncio.Future[EngineResult]:
        """`receive`, started within this call (on a running event loop): its
        result if the receive ended here, else a future of it. Only a receive
        at a GEN rank hosted by this very loop can end here (a pulled one
        whose READ ended at once: `GenRankCore.receive_at_once`); an engine
        thread waiting for the answer then waits for no turn of the loop.
        Raises as `receive` does, before anything was sent."""
        self._check_open()
        ticket = self._ticket(ticket)
        ids = checks.check_blocks(ticket.num_tokens, blocks, self.plan.layout)
        checks.check_timeout(timeout)
        parent = ticket.parent
        start = time.perf_counter()
        # Between instances of one rank each, the GEN rank drives the whole
        # receive and answers it (`receive_alone`: no coordinator on the
        # way); else the GEN coordinator claims and admits it in a round.
        at_rank = self._at_rank
        submission: asyncio.Future[Any]
        if at_rank:
            request = AdmissionRequest(parent, ticket.num_tokens, release_when_ready=True, blocks=ids)
            submission = asyncio.get_running_loop().create_future()
            try:
                started = self._receive_at_rank(request, timeout, ticket.lend)
            except Exception as exc:  # raised on this loop: the rest handles it as if awaited
                submission.set_exception(exc)
            else:
                if isinstance(started, tuple):
                    decided, back = started
                    if decided in ("completed", "rejected") and back:
                        return self._received(parent, decided, back, start)
                    submission.set_result(started)
                else:
                    submission = started
        else:
            submission = self._submitter.submit(
                self._coords[Role.GEN], SubmitRequest(parent, ticket.num_tokens, True, tuple(ids))
            )
        return asyncio.ensure_future(self._receive_rest(parent, submission, at_rank, start, timeout))

    def _received(self, parent: ParentKey, decided: str, back: bool, start: float) -> EngineResult:
        latency = time.perf_counter() - start
        record_handoff(self.plan.name, decided, latency)
        return EngineResult(request_id=parent.request_id, outcome=decided, blocks_returned=back, latency_s=latency)

    async def _receive_rest(
        self, parent: ParentKey, submission: asyncio.Future[Any], at_rank: bool, start: float, timeout: float
    ) -> EngineResult:
        back = None
        try:
            # The rank answers "timeout" itself: wait a round bound longer.
            bound = timeout + self._round_timeout_s if at_rank else timeout
            answer = await asyncio.wait_for(asyncio.shield(submission), bound)
            decided, back = answer if at_rank else (answer, None)
        except TimeoutError:
            decided = "timeout"
        except asyncio.CancelledError:
            # The caller went away: end the attempt in both instances (sent
            # after the submission: Ray keeps their order), owned by us.
            self._spawn(self._cancel_parent(parent))
            raise
        except ParentInFlight:
            return refused_duplicate(self.plan.name, parent, start)
        except Exception as exc:  # the coordinator (or the GEN rank) died: an outcome
            log.warning("%s: receive of %s raised: %r", self.plan.name, parent, exc)
            decided = "failed"
        if decided not in ("completed", "rejected"):
            await self._cancel_parent(parent)  # idempotent; ends a timed-out one
            back = None
        if back is None:
            left = max(timeout - (time.perf_counter() - start), self._round_timeout_s)
            back = await self._returned(parent, Role.GEN, left)
        if decided == "completed" and not back:
            decided = "failed"  # not given back within the bound: never decode from it
        return self._received(parent, str(decided), back, start)

    @property
    def _at_rank(self) -> bool:
        """Instances of one rank each: a publish and a receive go to the rank
        (`publish_alone`, `receive_alone`), with no coordinator round."""
        return self.plan.gen.tp == 1 and self.plan.ctx.tp == 1

    def _publish_at_rank(self, request: AdmissionRequest) -> asyncio.Future[bool | Lend]:
        """The CTX rank's `publish_alone` of ``request``, reached as
        `_receive_at_rank` reaches the GEN rank (on its loop when this process
        hosts it, else one Ray call)."""
        rank = self._ranks[Role.CTX][0]
        here = hosted_here(rank)
        if here is None:
            self.calls["publish_at_rank"] += 1
            return asyncio.ensure_future(_ref(rank.publish_alone.remote(request)))
        endpoint, loop = here
        self.calls["publish_at_rank_here"] += 1
        assert isinstance(endpoint, CtxRankCore)
        if loop is asyncio.get_running_loop():
            self.calls["publish_at_rank_on_its_loop"] += 1
            return asyncio.ensure_future(endpoint.publish_alone(request))
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(endpoint.publish_alone(request), loop))

    def _receive_at_rank(
        self, request: AdmissionRequest, timeout: float, lend: Lend | None
    ) -> asyncio.Future[Any] | tuple[str, bool]:
        """The GEN rank's `receive_alone` of ``request``: on its loop when this
        process hosts it (an engine's front end beside its decode worker: no
        Ray hop either way; called on that very loop, not even a thread hop,
        and its answer if it ended at once: `receive_at_once`), else one Ray call."""
        rank = self._ranks[Role.GEN][0]
        here = hosted_here(rank)
        if here is None:
            self.calls["receive_at_rank"] += 1
            return asyncio.ensure_future(_ref(rank.receive_alone.remote(request, timeout, lend)))
        endpoint, loop = here
        self.calls["receive_at_rank_here"] += 1
        assert isinstance(endpoint, GenRankCore)
        if loop is asyncio.get_running_loop():  # called on the endpoint's own loop: no hop at all
            self.calls["receive_at_rank_on_its_loop"] += 1
            started = endpoint.receive_at_once(request, timeout, lend)
            return started if isinstance(started, tuple) else asyncio.ensure_future(started)
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(endpoint.receive_alone(request, timeout, lend), loop))

    # -- either side ------------------------------------------------------------------

    async def reattach(self, role: Role | str, rank: int, worker: Any) -> int:
        """Re-attach a restarted engine worker as rank `rank` of `role`'s
        instance, without rebuilding anything or touching the other
        instance's workers: `worker` hosts a new endpoint (`ctx_endpoint` /
        `gen_endpoint` in its constructor: a new epoch, a new NIXL agent over
        its tensors). The old incarnation is retired (its peers end their
        sessions with it; its frames are stale from now on), handoffs still
        in flight in that instance end failed, and the new one joins at the
        next round; the instance admits again once no worker is detached (a
        worker that died or missed a round bound is detached until then:
        `stats()["coordinators"][role]["detached"]`). Returns the new epoch.
        Raises `InvalidRequest` for a rank out of range and `LaunchFailed`
        when the worker does not answer as that rank."""
        self._check_open()
        try:
            role = Role(role)
        except ValueError:
            raise InvalidRequest(f"role must be 'ctx' or 'gen', got {checks.short(role)}") from None
        tp = self.plan.spec(role).tp
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
            raise InvalidRequest(f"rank must be an int in [0, {tp}), got {checks.short(rank)}")
        try:
            epoch = int(await self._coords[role].replace_rank.remote(rank, worker))
            await worker.connect.remote()
        except Exception as exc:
            raise LaunchFailed(self.plan.name, f"{role.value} rank {rank} could not re-attach: {exc}") from exc
        self._ranks[role][rank] = worker
        return epoch

    async def cancel(self, ticket: HandoffTicket | str) -> None:
        """Cancel at any moment, from either side (module docstring, step 7).
        Returns once the CTX ranks applied the cancel and got the ticket's
        blocks back (a lent ticket's: once its reader answered the FENCE),
        or a round bound passed: a receive of the ticket after it is
        refused, pushed or lent."""
        self._check_open()
        ticket = self._ticket(ticket)
        await self._cancel_parent(ticket.parent)
        await self._returned(ticket.parent, Role.CTX, self._round_timeout_s)

    async def returned(self, ticket: HandoffTicket | str, role: Role, timeout: float = 60.0) -> bool:
        """True once every rank of ``role`` holds none of the ticket's blocks
        (the engine may reuse them); False if ``timeout`` passed first."""
        self._check_open()
        return await self._returned(self._ticket(ticket).parent, Role(role), timeout)

    # -- internals -----------------------------------------------------------------------

    def _stats_head(self) -> dict[str, Any]:
        return {"deployment": self.plan.name}

    def _default_carrier(self) -> dict[str, Any]:
        return {"carrier": self.plan.control_frames}

    def _known_ranks(self, role: Role) -> list[Any]:
        return self._ranks.get(role, [])

    async def _teardown(self) -> None:
        if self._owns:  # a handle from `connect` stops nothing it did not start
            await super()._teardown()

    def _ticket(self, ticket: Any) -> HandoffTicket:
        ticket = checks.own_ticket(ticket, self.plan.name)
        if ticket.ctx_instance != self.plan.ctx.instance_id or ticket.ctx_digest != self._ctx_digest:
            raise StaleTicket(f"ticket of another CTX topology ({ticket.ctx_instance!r})")
        return ticket

    async def _returned(self, parent: ParentKey, role: Role, timeout: float) -> bool:
        answers = await asyncio.gather(
            *(h.returned.remote(parent, timeout) for h in self._ranks[role]), return_exceptions=True
        )
        return all(a is True for a in answers)
