"""`EngineFleet`: many engine instances, any-to-any handoffs (docs/design.md "Fleet").

The fleet form of `EngineDeployment` (actors/engine.py): the engine owns
its workers, tensors and block managers; kvhandoff owns the handoffs and
the membership. Every instance is one engine instance (one TP group of the
engine's worker actors, each hosting an endpoint) with its own coordinator:

    fleet = await EngineFleet.create(layout=layout)
    plan = await fleet.plan("ctx", tp=2, memory_kind="paged")     # -> its workers
    await fleet.attach(plan, workers)                             # serves
    ticket = await fleet.publish("req-1", 300, blocks, ctx=plan.instance)
    r = await fleet.receive(ticket.encode(), gen_blocks, gen=gen_plan.instance)

An instance is named by its instance id (`<fleet>-<name>-i<incarnation>`,
`plan.instance`); a ticket carries its CTX instance's id and digest, so a
ticket of an old incarnation is refused (`StaleTicket`). A CTX instance
publishes before any GEN instance is chosen: the parent is admitted
unpaired, the GEN instance that claims the ticket (a ticket is claimed once)
is the one whose OPENs bind it on every CTX rank. Membership is as for
`Fleet`: `attach` pairs every live worker of the other role with the new
instance before it is used; `drain` stops admissions, waits until nothing of
it is in flight, and removes it (peers unload its agents); `reattach`
replaces one worker; a worker that dies or misses a round bound detaches
its rank (its instance admits nothing until the engine re-attaches it).
The data plane is direct.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from kvhandoff.actors import _checks as checks
from kvhandoff.actors._carrier import CarrierChoice, choose_carrier
from kvhandoff.actors._client import ClientCore
from kvhandoff.actors._config import EngineFleetConfig
from kvhandoff.actors._config import checked as checks_config
from kvhandoff.actors._coordinator_errors import AdmissionStopped, ParentInFlight
from kvhandoff.actors._directory import Directory
from kvhandoff.actors._errors import (
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
    StaleTicket,
)
from kvhandoff.actors._instance import await_started, start_coordinator
from kvhandoff.actors._membership import coordinator_stats, drained, rank_stats, take_out
from kvhandoff.actors._metrics import record_handoff
from kvhandoff.actors._submit import SubmitRequest, Submitter
from kvhandoff.actors.endpoint import EnginePlan
from kvhandoff.actors.engine import EngineResult, PublishRefused, refused_duplicate
from kvhandoff.actors.fleet import InstanceUnavailable, UnknownInstance
from kvhandoff.protocol import (
    HandoffTicket,
    MemoryKind,
    ParentKey,
    RecentMemory,
    Role,
    TopologyError,
)
from kvhandoff.topology import KVLayout, TopologySpec, check_memory_kind, shard_map, topology_digest

__all__ = ["EngineFleet", "FleetInstance"]

log = logging.getLogger("kvhandoff.engine_fleet")

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


@dataclass
class _EngineInstance:
    name: str
    role: Role
    tp: int
    incarnation: int
    spec: TopologySpec
    plan: EnginePlan
    memory_kind: str
    state: str = "planned"  # planned | serving | draining | detached | removed
    coord: Any = None
    workers: list[Any] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.spec.instance_id


class EngineFleet(ClientCore):
    """The control side of a fleet of engine instances (module docstring)."""

    _kills_ranks = False  # the engine's workers are the engine's

    def __init__(self, name: str, layout: KVLayout) -> None:
        super().__init__()
        self.name = name
        self.layout = layout
        self._by_id: dict[str, _EngineInstance] = {}
        self._names: dict[str, _EngineInstance] = {}  # logical name -> current incarnation
        self._counters = {Role.CTX: 0, Role.GEN: 0}
        self._common: dict[str, Any] = {}
        #: The control-frame carrier taken at launch (actors/_carrier.py).
        self.carrier: CarrierChoice | None = None
        self._round_timeout_s = 5.0
        self._received: RecentMemory[ParentKey, str] = RecentMemory()
        self._membership = asyncio.Lock()
        self._layout = layout

    @classmethod
    async def create(cls, config: EngineFleetConfig | None = None, /, **fields: Any) -> EngineFleet:
        """Check the settings every instance shares (an `EngineFleetConfig`,
        its fields as keywords, or both: `InvalidConfig`) and start the
        fleet's directory; then `plan` and `attach` instances."""
        cfg = checks_config(EngineFleetConfig, config, **fields)
        mem = MemoryKind(cfg.memory)
        self = cls(cfg.name or f"kvh-{uuid.uuid4().hex[:8]}", cfg.layout)
        self._round_timeout_s = cfg.round_timeout_s
        self._common = {
            "memory": mem,
            "transfer_timeout_s": cfg.transfer_timeout_s,
            "chunk_bytes": cfg.chunk_bytes,
            "lease_timeout_s": cfg.lease_timeout_s,
            "control_frames": cfg.control_frames,
        }
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.carrier = await choose_carrier(cfg.control_frames)
        self._common["control_frames"] = self.carrier.carrier
        self._directory = Directory.options(name=f"{self.name}.directory").remote()
        await self._directory.descriptors.remote()  # up before any endpoint registers
        return self

    # -- membership -------------------------------------------------------------------

    async def plan(self, role: str | Role, tp: int, *, memory_kind: str = "paged", name: str | None = None) -> EnginePlan:
        """Plan a new instance of `role` (or, with the `name` of one removed,
        its next incarnation): the plan its workers build their endpoints
        from (`ctx_endpoint` / `gen_endpoint`); `plan.instance` is its id.
        Raises `InvalidConfig` for a TP that cannot pair with a live instance
        of the other role, a bad memory kind or name."""
        self._check_open()
        try:
            role = Role(role)
            check_memory_kind(memory_kind)
        except (ValueError, TopologyError) as exc:
            raise InvalidConfig(str(exc)) from None
        checks.check_int("tp", tp, 1)
        if name is None:
            name = f"{role.value}{self._counters[role]}"
            self._counters[role] += 1
        elif not isinstance(name, str) or not _NAME.match(name):
            raise InvalidConfig(f"instance name must match {_NAME.pattern}, got {checks.short(name)}")
        before = self._names.get(name)
        if before is not None and before.state not in ("removed",):
            raise InvalidConfig(f"instance {name!r} exists ({before.state}): a new incarnation needs it removed")
        others = [i for i in self._names.values() if i.role is not role and i.state in ("serving", "draining", "detached")]
        for other in others:
            c, g = (tp, other.tp) if role is Role.CTX else (other.tp, tp)
            try:
                shard_map(self.layout, c, g)
            except (TopologyError, ValueError) as exc:
                raise InvalidConfig(f"a CTX tp={c} and a GEN tp={g} instance cannot pair: {exc}") from None
        incarnation = before.incarnation + 1 if before is not None else 1
        spec = TopologySpec(
            instance_id=f"{self.name}-{name}-i{incarnation}", role=role, tp=tp,
            memory=self._common["memory"], transfer_timeout_s=self._common["transfer_timeout_s"],
        )
        other_role = Role.GEN if role is Role.CTX else Role.CTX
        peer = others[0].spec if others else TopologySpec(
            instance_id=f"{self.name}-none", role=other_role, tp=1,
            memory=self._common["memory"], transfer_timeout_s=self._common["transfer_timeout_s"],
        )
        peer_kind = others[0].memory_kind if others else memory_kind
        ctx, gen = (spec, peer) if role is Role.CTX else (peer, spec)
        plan = EnginePlan(
            name=self.name,
            ctx=ctx,
            gen=gen,
            layout=self.layout,
            ctx_memory=memory_kind if role is Role.CTX else peer_kind,
            gen_memory=memory_kind if role is Role.GEN else peer_kind,
            chunk_bytes=self._common["chunk_bytes"],
            lease_timeout_s=self._common["lease_timeout_s"],
            control_frames=self._common["control_frames"],
            data_mode="direct",
            instance=spec.instance_id,
        )
        inst = _EngineInstance(name=name, role=role, tp=tp, incarnation=incarnation, spec=spec, plan=plan, memory_kind=memory_kind)
        self._names[name] = inst
        self._by_id[spec.instance_id] = inst
        await self._directory.add_instance.remote(spec, memory_kind)
        return plan

    async def attach(self, plan: EnginePlan, workers: list[Any], *, start_timeout_s: float = 600.0) -> None:
        """Start the instance's coordinator over the engine's `workers` (rank
        r is the r-th), wait until each registered, then pair: its workers
        negotiate with every instance of the other role, and every live
        worker of the other role pairs with it (awaited). Then it serves.
        Raises `LaunchFailed` (and takes the instance out) on failure."""
        self._check_open()
        inst = self._by_id.get(plan.instance)
        if inst is None or inst.state != "planned":
            raise InvalidRequest(f"plan {plan.instance!r} is not a planned instance of this fleet")
        if len(workers) != inst.tp:
            raise InvalidConfig(f"instance {inst.name} has tp={inst.tp}, got {len(workers)} workers")
        async with self._membership:
            inst.workers = list(workers)
            inst.coord = start_coordinator(
                f"{self.name}.coord.{inst.id}",
                inst.spec,
                inst.workers,
                round_timeout=self._round_timeout_s,
                max_restarts=0,
                fleet=self.name,
                peer_claims=inst.role is Role.GEN,
                # One GEN rank claims a ticket of one CTX rank with no round.
                admits_alone=inst.role is Role.GEN and inst.spec.tp == 1,
                reattach=f"{self.name}.directory",
                client_channels=self._common["control_frames"] == "stream",
            )
            label = f"instance {inst.name}:"
            try:
                await await_started(self.name, {label: inst.coord}, {label: inst.id}, self._directory, start_timeout_s)
                peers = [w for o in self._live(Role.GEN if inst.role is Role.CTX else Role.CTX) for w in o.workers]
                await asyncio.gather(
                    *(w.connect.remote() for w in inst.workers),
                    *(w.peer_joined.remote(inst.spec, inst.memory_kind) for w in peers),
                )
            except Exception as exc:
                await self._remove(inst)
                if isinstance(exc, LaunchFailed):
                    raise
                raise LaunchFailed(self.name, f"instance {inst.name}: {type(exc).__name__}: {exc}") from exc
            inst.state = "serving"

    async def drain(self, instance: str, timeout: float = 120.0) -> bool:
        """Stop admissions into `instance` (its coordinator refuses them:
        publish raises `PublishRefused`, a receive ends "rejected"), wait
        until nothing of it is in flight (its rounds, and every peer worker's
        live parents with it), then remove it: every peer forgets it and
        unloads its agents. The engine stops its workers afterwards. True
        when removed within `timeout`; False if still busy (call again)."""
        self._check_open()
        inst = self._instance(instance)
        if inst.state not in ("serving", "draining"):
            raise InstanceUnavailable(inst.name, inst.state)
        inst.state = "draining"

        async def peers() -> list[Any]:
            return [w for o in self._live(Role.GEN if inst.role is Role.CTX else Role.CTX) for w in o.workers]

        if not await drained(inst.coord, inst.id, peers, timeout):
            return False
        await self._remove(inst)
        return True

    async def _remove(self, inst: _EngineInstance) -> None:
        inst.state = "removed"
        gens = [o.coord for o in self._live(Role.GEN)]
        await take_out(self._directory, inst.id, inst.role, inst.coord, gens, kill_ranks=False)

    async def reattach(self, instance: str, rank: int, worker: Any) -> int:
        """`EngineDeployment.reattach` for one instance of the fleet."""
        self._check_open()
        inst = self._instance(instance)
        if inst.state not in ("serving", "draining"):
            raise InstanceUnavailable(inst.name, inst.state)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < inst.tp:
            raise InvalidRequest(f"rank must be an int in [0, {inst.tp}), got {checks.short(rank)}")
        try:
            epoch = int(await inst.coord.replace_rank.remote(rank, worker))
            await worker.connect.remote()
        except Exception as exc:
            raise LaunchFailed(self.name, f"{inst.name} rank {rank} could not re-attach: {exc}") from exc
        inst.workers[rank] = worker
        return epoch

    # -- handoffs -----------------------------------------------------------------------

    async def publish(self, request_id: str, num_tokens: int, blocks: Any, *, ctx: str) -> HandoffTicket:
        """`EngineDeployment.publish` on CTX instance `ctx` (its id). The
        ticket names that instance and its incarnation."""
        self._check_open()
        inst = self._serving(ctx, Role.CTX)
        return await _publish(self.name, inst.coord, inst.id, inst.spec, self._layout, request_id, num_tokens, blocks)

    async def receive(self, ticket: HandoffTicket | str, blocks: Any, *, gen: str, timeout: float = 60.0) -> EngineResult:
        """`EngineDeployment.receive` into GEN instance `gen` (its id): the
        GEN coordinator claims the ticket on the CTX instance it names."""
        self._check_open()
        ticket = self._ticket(ticket)
        inst = self._serving(gen, Role.GEN)
        ids = checks.check_blocks(ticket.num_tokens, blocks, self._layout)
        checks.check_timeout(timeout)
        parent = ticket.parent
        self._received.remember(parent, inst.id, time.monotonic())
        start = time.perf_counter()
        try:
            decided = await _submitted(self.name, self._submitter, inst.coord, ticket, ids, timeout)
        except ParentInFlight:
            return refused_duplicate(self.name, parent, start)
        except asyncio.CancelledError:
            self._spawn(self._cancel_parent(parent, ticket.ctx_instance))
            raise
        if decided not in ("completed", "rejected"):
            await self._cancel_parent(parent, ticket.ctx_instance)
        left = max(timeout - (time.perf_counter() - start), self._round_timeout_s)
        return await _result(self.name, inst.workers, parent, decided, start, left)

    async def cancel(self, ticket: HandoffTicket | str) -> None:
        """Cancel at any moment, from either side, in one call: to the
        ticket's CTX instance, which forwards to the GEN instance that
        claimed it (every GEN instance only if the CTX instance's
        coordinator cannot be asked). Returns once that coordinator's workers
        applied the cancel (its answer waits for them, under its round
        bound): a receive of the ticket after it is refused."""
        self._check_open()
        ticket = self._ticket(ticket)
        await self._cancel_parent(ticket.parent, ticket.ctx_instance)

    async def returned(self, ticket: HandoffTicket | str, role: Role | str, timeout: float = 60.0) -> bool:
        """True once every worker of `role` that held the ticket's blocks
        (the CTX instance it names; the GEN instance that received it) holds
        none of them any more."""
        self._check_open()
        ticket = self._ticket(ticket)
        role = Role(role)
        instance = ticket.ctx_instance if role is Role.CTX else self._received.get(ticket.parent)
        inst = self._by_id.get(instance or "")
        if inst is None:
            return True  # no GEN instance ever received it: none holds it
        return await _returned_on(inst.workers, ticket.parent, timeout)

    # -- views ------------------------------------------------------------------------------

    def instances(self) -> list[dict[str, Any]]:
        """Every instance: {id (logical name), instance_id, role, tp, incarnation, state}."""
        return [
            {"id": i.name, "instance_id": i.id, "role": i.role.value, "tp": i.tp, "incarnation": i.incarnation, "state": i.state}
            for i in self._names.values()
        ]

    async def stats(self) -> dict[str, Any]:
        """Every live instance's coordinator and every worker's endpoint stats."""
        self._check_open()
        live = [i for i in self._names.values() if i.state in ("serving", "draining", "detached")]
        out = await rank_stats([(i.name, i.role, r, w) for i in live for r, w in enumerate(i.workers)])
        return {
            "fleet": self.name,
            "instances": self.instances(),
            "ranks": out,
            "coordinators": await coordinator_stats([(i.name, i.coord) for i in live]),
        }

    # -- internals ----------------------------------------------------------------------------

    def _coordinators(self) -> list[Any]:
        return [i.coord for i in self._by_id.values() if i.coord is not None]

    def _live(self, role: Role) -> list[_EngineInstance]:
        return [i for i in self._names.values() if i.role is role and i.state in ("serving", "draining", "detached")]

    def _instance(self, instance: Any) -> _EngineInstance:
        inst = self._by_id.get(instance) if isinstance(instance, str) else None
        if inst is None:
            raise UnknownInstance(str(instance)[:80], sorted(self._by_id))
        return inst

    def _serving(self, instance: Any, role: Role) -> _EngineInstance:
        inst = self._instance(instance)
        if inst.role is not role:
            raise InstanceUnavailable(inst.name, f"a {inst.role.value} instance, not {role.value}")
        if inst.state != "serving":
            raise InstanceUnavailable(inst.name, inst.state)
        return inst

    def _ticket(self, ticket: Any) -> HandoffTicket:
        ticket = checks.own_ticket(ticket, self.name)
        inst = self._by_id.get(ticket.ctx_instance)
        if inst is None or inst.role is not Role.CTX or ticket.ctx_digest != topology_digest(inst.spec):
            raise StaleTicket(f"ticket of a CTX instance this fleet does not have ({ticket.ctx_instance!r})")
        if inst.state == "removed":
            raise StaleTicket(f"ticket of CTX instance {inst.name} incarnation {inst.incarnation}, which left the fleet")
        return ticket

    async def _cancel_parent(self, parent: ParentKey, ctx_instance: str) -> None:
        ctx = self._by_id.get(ctx_instance)
        home = ctx.coord if ctx is not None and ctx.state != "removed" else None
        await _cancel_once(self.name, parent, home, lambda: [i.coord for i in self._live(Role.GEN)])


class FleetInstance:
    """One instance's view of its fleet, from any process: what an engine's
    front end beside its workers (a vLLM engine's scheduler, say) needs to
    publish into or receive into *its own* instance, with the signatures of
    `EngineDeployment` (publish / receive / cancel / returned), so the same
    engine code serves a single pair or a fleet.

        handle = await FleetInstance.connect(plan)    # plan: from EngineFleet.plan

    It finds its coordinator, its workers and the fleet's directory by name;
    the membership it checks tickets against is the directory's (the CTX
    instances that serve now, with their digests), read again when a ticket
    names an instance it does not know. Membership changes (attach, drain,
    reattach) stay with the `EngineFleet` that planned the instance."""

    def __init__(self, plan: EnginePlan) -> None:
        if not plan.instance:
            raise InvalidRequest("FleetInstance.connect needs an instance's plan (EngineFleet.plan)")
        self.plan = plan
        self.name = plan.name
        self.role = Role.CTX if plan.ctx.instance_id == plan.instance else Role.GEN
        self._coord: Any = None
        self._workers: list[Any] = []
        self._submitter = Submitter()
        self._directory: Any = None
        self._ctx_digests: dict[str, str] = {}  # serving CTX instance id -> its digest
        self._gen_coords: dict[str, Any] = {}
        self._layout = plan.layout

    @classmethod
    async def connect(cls, plan: EnginePlan) -> FleetInstance:
        self = cls(plan)
        self._coord = ray.get_actor(f"{plan.name}.coord.{plan.instance}")
        self._workers = list(await self._coord.rank_handles.remote())
        self._directory = ray.get_actor(f"{plan.name}.directory")
        await self._membership()
        return self

    def close(self) -> None:
        """Close this handle's submission channels (actors/_submit.py); later
        submissions go by Ray call."""
        self._submitter.close()

    async def publish(self, request_id: str, num_tokens: int, blocks: Any) -> HandoffTicket:
        """`EngineFleet.publish` on this (CTX) instance."""
        self._check_role(Role.CTX)
        plan = self.plan
        return await _publish(self.name, self._coord, plan.instance, plan.ctx, self._layout, request_id, num_tokens, blocks)

    async def receive(self, ticket: HandoffTicket | str, blocks: Any, *, timeout: float = 60.0) -> EngineResult:
        """`EngineFleet.receive` into this (GEN) instance."""
        self._check_role(Role.GEN)
        ticket = await self._ticket(ticket)
        ids = checks.check_blocks(ticket.num_tokens, blocks, self._layout)
        checks.check_timeout(timeout)
        parent = ticket.parent
        start = time.perf_counter()
        try:
            decided = await _submitted(self.name, self._submitter, self._coord, ticket, ids, timeout)
        except ParentInFlight:
            return refused_duplicate(self.name, parent, start)
        if decided not in ("completed", "rejected"):
            await self._cancel_parent(parent, ticket.ctx_instance)
        left = max(timeout - (time.perf_counter() - start), 5.0)
        return await _result(self.name, self._workers, parent, decided, start, left)

    async def cancel(self, ticket: HandoffTicket | str) -> None:
        """Cancel at any moment, in one call: to the ticket's CTX instance,
        which forwards to the GEN instance that claimed it (every serving GEN
        instance only if the CTX instance's coordinator cannot be asked).
        Returns as `EngineFleet.cancel` does: once the CTX instance's
        workers applied it."""
        ticket = await self._ticket(ticket)
        await self._cancel_parent(ticket.parent, ticket.ctx_instance)

    async def returned(self, ticket: HandoffTicket | str, role: Role | str, timeout: float = 60.0) -> bool:
        """True once this instance's workers hold none of the ticket's blocks
        (``role`` must be this instance's)."""
        self._check_role(Role(role))
        ticket = await self._ticket(ticket)
        answers = await asyncio.gather(
            *(w.returned.remote(ticket.parent, timeout) for w in self._workers), return_exceptions=True
        )
        return all(a is True for a in answers)

    # -- internals ----------------------------------------------------------------------------

    def _check_role(self, role: Role) -> None:
        if role is not self.role:
            raise InvalidRequest(f"instance {self.plan.instance!r} is a {self.role.value} instance, not {role.value}")

    async def _membership(self) -> None:
        specs = await self._directory.instances.remote()
        self._ctx_digests = {s.instance_id: topology_digest(s) for s, _ in specs if s.role is Role.CTX}
        gens = {s.instance_id for s, _ in specs if s.role is Role.GEN}
        self._gen_coords = {i: c for i, c in self._gen_coords.items() if i in gens}
        for instance in gens - set(self._gen_coords):
            with contextlib.suppress(ValueError):  # not started yet (planned): no coordinator to tell
                self._gen_coords[instance] = ray.get_actor(f"{self.name}.coord.{instance}")

    async def _ticket(self, ticket: Any) -> HandoffTicket:
        ticket = checks.own_ticket(ticket, self.name)
        if ticket.ctx_instance not in self._ctx_digests:
            await self._membership()
        digest = self._ctx_digests.get(ticket.ctx_instance)
        if digest is None or digest != ticket.ctx_digest:
            raise StaleTicket(f"ticket of a CTX instance this fleet does not serve ({ticket.ctx_instance!r})")
        return ticket

    async def _cancel_parent(self, parent: ParentKey, ctx_instance: str) -> None:
        home = None
        with contextlib.suppress(ValueError):  # the CTX instance left
            home = ray.get_actor(f"{self.name}.coord.{ctx_instance}")
        if home is None:
            await self._membership()  # a GEN instance that joined since may hold it
        await _cancel_once(self.name, parent, home, lambda: list(self._gen_coords.values()))


async def _cancel_once(name: str, parent: ParentKey, home: Any, gens: Callable[[], list[Any]]) -> None:
    """Cancel a ticket's parent in one call, to its CTX instance's coordinator
    (`home`): it cancels there and forwards to the GEN instance that claimed
    the ticket, if one did (`Coordinator.claim_many`). Only when `home`
    cannot be asked (the instance left, or its coordinator died) does every
    GEN coordinator in `gens()` get the cancel: one that never claimed the
    ticket changes nothing."""
    if home is not None:
        try:
            await home.cancel.remote(parent)
            return
        except Exception as exc:
            log.debug("%s: cancel of %s on its CTX coordinator raised: %r", name, parent, exc)
    await asyncio.gather(*(c.cancel.remote(parent) for c in gens()), return_exceptions=True)


async def _publish(
    name: str, coord: Any, instance: str, spec: TopologySpec, layout: KVLayout, request_id: Any, num_tokens: Any, blocks: Any
) -> HandoffTicket:
    """Admit a prefilled request on CTX instance `instance` (its coordinator
    `coord`) and name it in a ticket; `PublishRefused` if a rank refused."""
    parent = checks.fresh_parent(request_id)
    ids = checks.check_blocks(num_tokens, blocks, layout)
    try:
        ok = await coord.admit.remote(parent, num_tokens, ids)
    except AdmissionStopped as exc:
        raise PublishRefused(request_id, f"the CTX instance admits nothing now: {exc.reason}") from None
    if not ok:
        raise PublishRefused(request_id, "a CTX rank refused the blocks (see its stats' counters)")
    return HandoffTicket(
        deployment=name,
        request_id=parent.request_id,
        ctx_attempt=parent.ctx_attempt,
        gen_attempt=parent.gen_attempt,
        ctx_instance=instance,
        ctx_digest=topology_digest(spec),
        num_tokens=num_tokens,
    )


async def _submitted(
    name: str, submitter: Submitter, coord: Any, ticket: HandoffTicket, ids: tuple[int, ...], timeout: float
) -> str:
    """Submit a claimed ticket to GEN coordinator `coord` (through the
    client's `submitter`: batched with its others) and wait for its
    decision, at most `timeout`: "timeout" then, and a coordinator that died
    or drains is an outcome ("failed", "rejected"), never an exception."""
    submission = submitter.submit(
        coord, SubmitRequest(ticket.parent, ticket.num_tokens, True, tuple(ids), ticket.ctx_instance)
    )
    try:
        return str(await asyncio.wait_for(asyncio.shield(submission), timeout))
    except TimeoutError:
        return "timeout"
    except ParentInFlight:
        raise  # a receive of this ticket is under way: the caller refuses this one
    except Exception as exc:  # its coordinator died, or it is draining: an outcome
        log.warning("%s: receive of %s raised: %r", name, ticket.parent, exc)
        return "rejected" if isinstance(exc, AdmissionStopped) else "failed"


async def _returned_on(workers: list[Any], parent: ParentKey, timeout: float) -> bool:
    """Whether every worker holds `parent`'s blocks again within `timeout`."""
    answers = await asyncio.gather(*(w.returned.remote(parent, timeout) for w in workers), return_exceptions=True)
    return all(a is True for a in answers)


async def _result(
    name: str, workers: list[Any], parent: ParentKey, decided: str, start: float, left: float
) -> EngineResult:
    """A receive's result once its GEN workers answered: "completed" only
    with every worker's blocks back (else "failed"), recorded in the metrics."""
    back = await _returned_on(workers, parent, left)
    if decided == "completed" and not back:
        decided = "failed"
    latency = time.perf_counter() - start
    record_handoff(name, decided, latency)
    return EngineResult(request_id=parent.request_id, outcome=decided, blocks_returned=back, latency_s=latency)
