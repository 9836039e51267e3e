"""`Fleet`: many CTX and many GEN instances, any-to-any handoffs (docs/design.md "Fleet").

A fleet is any number of CTX (prefill) and GEN (decode) instances in one Ray
cluster, each a TP group of rank actors with its own coordinator, TP free per
instance (any pair the shard mapping supports). A handoff pairs one CTX
instance with one GEN instance: the caller names them (its router decides),
or the built-in chooser picks the GEN instance with the most free blocks and
the CTX instance round-robin:

    fleet = await Fleet.launch(ctx=[2, 1], gen=[1, 2])        # TP per instance
    r = await fleet.handoff("req-1", num_tokens=300)           # chooser
    r = await fleet.handoff("req-2", 300, ctx="ctx1", gen="gen0")
    await fleet.add_instance("gen", tp=1)                       # joins mid-traffic
    await fleet.drain("gen0")                                   # finishes, then leaves
    await fleet.shutdown()

What a fleet shares and what it does not
----------------------------------------
- One directory (`<fleet>.directory`): every rank's entry by (instance id,
  rank), and the instance table from which a rank learns the instances of
  the other role (`RankConfig.fleet`). Nothing else is fleet-wide: rounds,
  pools, agents and restarts stay per instance.
- Pairs: each rank negotiates the protocol with each peer instance from the
  descriptors of the two instances' ranks (cached per pair, redone when a
  peer incarnation re-registers); remote NIXL agents are loaded on a pair's
  first handoff and unloaded on every survivor when a peer instance leaves,
  once nothing with it is live.
- The coordinators: the GEN coordinator of a handoff admits it in its own
  instance and, in the same round, asks the CTX instance the handoff names
  (`<fleet>.coord.<id>`, one call per CTX instance per round), unless that
  CTX instance has one rank: then its rank admits the handoff at its OPEN
  (`admit_at_open`, the default; docs/design.md "Admission at the OPEN").

Membership is by incarnation
----------------------------
An instance has a logical name ("ctx0", "gen1") and an incarnation; its
instance id (in every endpoint, ticket and digest) is
`<fleet>-<name>-i<incarnation>`, so anything of an old incarnation is stale
(S3), never merely late. `add_instance` starts a new instance (or, with the
name of one that died, its replacement with the next incarnation): it serves
once its ranks registered and every rank of the other role negotiated with
it; nobody pauses. `drain` stops admissions into an instance, waits until no
handoff touches it any more (its rounds and every peer rank's live parents),
then removes it: peers forget it and unload its agents. The death of an
instance's coordinator (its ranks die with it: Ray ends the actors an actor
owns) is seen at once by the fleet's watch (a call the coordinator never
answers fails when it dies): the instance is fenced (no new handoff is
routed to it), its ranks are retired in the directory (peers end their
sessions with them; the directory confirms each death, the proof that lets a
GEN rank reclaim what a dead writer left quarantined) and the instance is
removed. A dead rank alone is the instance's own business: its coordinator
restarts it with a new epoch (docs/design.md "Quarantine and reclaim"); only
handoffs touching that instance fail.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from kvhandoff.actors._carrier import choose_carrier
from kvhandoff.actors._checks import check_int, check_timeout, short
from kvhandoff.actors._client import stop_actors
from kvhandoff.actors._config import FleetConfig, checked
from kvhandoff.actors._directory import Directory
from kvhandoff.actors._errors import (
    DeploymentError,
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
    PlacementFailed,
)
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors._instance import await_started, connected, start_coordinator
from kvhandoff.actors._launch import _RankFactory, placed, rank_configs
from kvhandoff.actors._membership import coordinator_stats, drained, rank_stats, take_out
from kvhandoff.actors._placement import (
    bundle_strategy,
    create_group,
    group_node,
    node_views,
    remove_group,
    wait_ready,
)
from kvhandoff.actors._submit import SubmitRequest
from kvhandoff.actors.deployment import (
    DEFAULT_LAYOUT,
    Deployment,
    HandoffResult,
    _Attempt,
)
from kvhandoff.actors.rank import RankConfig
from kvhandoff.protocol import MemoryKind, Role, TopologyError
from kvhandoff.topology import (
    TopologySpec,
    blocks_for_tokens,
    check_memory_kind,
    qualify_pair,
    shard_map,
    unplaced_reasons,
)

__all__ = ["Fleet", "InstanceUnavailable", "UnknownInstance"]

log = logging.getLogger("kvhandoff.fleet")

#: A logical instance name: short, and safe inside an instance id.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


class UnknownInstance(InvalidRequest):
    """A handoff or call names an instance the fleet never had. Nothing changed."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        super().__init__(f"no instance {name!r} in this fleet (instances: {', '.join(known) or 'none'})")


class InstanceUnavailable(DeploymentError):
    """The named instance is draining, dead or removed, or has the wrong role:
    nothing was sent to it. `state` says which."""

    def __init__(self, name: str, state: str) -> None:
        self.name = name
        self.state = state
        super().__init__(f"instance {name!r} is {state}: it takes no new handoffs")


@dataclass
class _Instance:
    """One instance as the fleet client sees it."""

    name: str
    role: Role
    tp: int
    incarnation: int
    spec: TopologySpec
    configs: list[RankConfig]
    resources: list[dict[str, Any]]
    state: str = "starting"  # starting | serving | draining | dead | removed
    coord: Any = None
    group: Any = None
    node: str = ""
    watch: asyncio.Task[None] | None = None
    # Blocks the client's in-flight handoffs lease here (the chooser's free estimate).
    leased: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def id(self) -> str:
        return self.spec.instance_id


class Fleet(Deployment):
    """Many CTX and GEN instances with any-to-any handoffs (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._instances: dict[str, _Instance] = {}  # logical name -> current incarnation
        self._by_id: dict[str, _Instance] = {}  # instance id -> incarnation (all, also ended)
        self._names = {Role.CTX: itertools.count(), Role.GEN: itertools.count()}
        self._rr = itertools.count()
        self._common: dict[str, Any] = {}
        self._memory_kind = "blocked"
        self._gpus_per_rank = 1.0
        self._placement_timeout_s = 120.0
        self._start_timeout_s = 600.0
        self._round_timeout_s = 5.0
        self._max_restarts = 3
        self._admit_at_open = True
        #: Handoff outcomes per pair of logical names: {"ctx0->gen1": Counter}.
        self.pair_outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        #: Membership events: (kind, instance name, seconds since launch).
        self.events: list[tuple[str, str, float]] = []
        self._t0 = time.monotonic()
        self._membership = asyncio.Lock()
        self._steer: dict[Role, tuple[dict[str, float], dict[str, str]]] = {Role.CTX: ({}, {}), Role.GEN: ({}, {})}

    # -- launch ---------------------------------------------------------------------

    @classmethod
    async def launch(  # type: ignore[override]
        cls, config: FleetConfig | None = None, /, *, fault_plan: FaultPlan | None = None, **fields: Any
    ) -> Fleet:
        """Start a fleet from a `FleetConfig` (actors/_config.py), its fields
        as keywords, or both (as `Deployment.launch`): `ctx` and `gen` are the
        TP of each instance (a list) or how many tp=1 instances (an int). Instances are named ctx0, ctx1,
        ... and gen0, gen1, ... Every pair of a CTX and a GEN instance must be
        supported by the shard mapping (the KV heads split by both TPs).

        Raises `InvalidConfig` before any actor starts for a configuration
        that can never work, and `LaunchFailed` (after stopping everything it
        started) when the instances did not come up within `start_timeout_s`.
        The fleet's data plane is direct (one descriptor per piece): staging
        arenas are partitioned per peer rank of one peer instance.

        Placement: each instance is one STRICT_PACK placement group (its
        ranks share a node; docs/design.md "Placement"); `ctx_resources` /
        `gen_resources` and `ctx_labels` / `gen_labels` steer every instance
        of that role to the nodes that carry them, as for `Deployment`.

        `control_frames` is as for `Deployment.launch`: one carrier for
        every instance, those that join later included ("auto" is measured
        once, at launch).

        `admit_at_open` (the default): every CTX instance of one rank, those
        that join later too, admits a handoff when its OPEN arrives instead
        of in a round, and a GEN coordinator asks it no admission (learned
        once per pair; docs/design.md "Admission at the OPEN"). CTX instances
        of several ranks admit in their rounds either way. False: every CTX
        instance admits in its rounds."""
        cfg = checked(FleetConfig, config, **fields)
        self = cls()
        self.name = cfg.name or f"kvh-{uuid.uuid4().hex[:8]}"
        ctx_tps, gen_tps = cfg.tps("ctx"), cfg.tps("gen")
        self._admit_at_open = cfg.admit_at_open
        try:
            check_memory_kind(cfg.memory_kind)
        except TopologyError as exc:
            raise InvalidConfig(str(exc)) from None
        mem = MemoryKind(cfg.memory)
        self.layout = cfg.layout or DEFAULT_LAYOUT
        self.pool_blocks = cfg.pool_blocks
        self.synthetic = cfg.synthetic
        self._memory_kind = cfg.memory_kind
        self._gpus_per_rank = cfg.gpus_per_rank
        self._placement_timeout_s = cfg.placement_timeout_s
        self._start_timeout_s = cfg.start_timeout_s
        self._round_timeout_s = cfg.round_timeout_s
        self._max_restarts = cfg.max_restarts
        self._steer = {
            Role.CTX: (dict(cfg.ctx_resources), dict(cfg.ctx_labels)),
            Role.GEN: (dict(cfg.gen_resources), dict(cfg.gen_labels)),
        }
        self._common = {
            "memory": mem,
            "transfer_timeout_s": cfg.transfer_timeout_s,
            "chunk_bytes": cfg.chunk_bytes,
            "lease_timeout_s": cfg.lease_timeout_s,
            "device": "cuda" if mem is MemoryKind.VRAM else "cpu",
            "frames": cfg.control_frames,
            "fault_plan": fault_plan,
        }
        for a in set(ctx_tps):  # every pair the fleet may form must split the KV heads
            for b in set(gen_tps):
                self._check_pair(a, b)
        # Each rank's default pair is the first instance of the other role.
        first = {Role.CTX: self._spec(Role.CTX, "ctx0", 1, ctx_tps[0]), Role.GEN: self._spec(Role.GEN, "gen0", 1, gen_tps[0])}
        planned = [self._plan_instance(Role.CTX, tp, peer=first[Role.GEN]) for tp in ctx_tps] + [
            self._plan_instance(Role.GEN, tp, peer=first[Role.CTX]) for tp in gen_tps
        ]
        verdict = qualify_pair(planned[0].spec, planned[-1].spec)
        self.qualified, self.unqualified_reasons = verdict.qualified, verdict.reasons
        self.ctx_spec = planned[0].spec  # the first of each role (Deployment's accessors)
        self.gen_spec = planned[-1].spec
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        if mem is MemoryKind.VRAM and not ray.cluster_resources().get("GPU", 0):
            raise InvalidConfig("memory='VRAM' puts each rank's KV pool on a GPU, but the Ray cluster has no GPU")
        # One carrier for the whole fleet, instances that join later included.
        self.carrier = await choose_carrier(cfg.control_frames)
        self._common["frames"] = self.carrier.carrier
        for inst in planned:
            inst.configs = [msgspec.structs.replace(c, frames=self.carrier.carrier) for c in inst.configs]
        self._reclaim_timeout_s = cfg.lease_timeout_s + 2 * cfg.transfer_timeout_s + 4 * cfg.round_timeout_s
        try:
            self._directory = Directory.options(name=f"{self.name}.directory").remote(self._common["fault_plan"])
            for inst in planned:
                await self._directory.add_instance.remote(inst.spec, cfg.memory_kind)
            await asyncio.gather(*(self._start_instance(inst) for inst in planned))
            # Every rank registered: each learns the instance table and negotiates per pair.
            await connected(self.name, await self._ranks_of(planned), self._start_timeout_s)
        except BaseException as exc:
            await self._teardown()
            if isinstance(exc, DeploymentError) or not isinstance(exc, Exception):
                raise
            raise LaunchFailed(self.name, f"{type(exc).__name__}: {exc}") from exc
        for inst in planned:
            self._serve(inst)
        self._coords = {Role.CTX: planned[0].coord, Role.GEN: planned[-1].coord}
        return self

    def _check_pair(self, ctx_tp: int, gen_tp: int) -> None:
        try:
            shard_map(self.layout, ctx_tp, gen_tp)
        except (TopologyError, ValueError) as exc:
            raise InvalidConfig(f"a CTX tp={ctx_tp} and a GEN tp={gen_tp} instance cannot pair: {exc}") from None

    def _spec(self, role: Role, name: str, incarnation: int, tp: int) -> TopologySpec:
        return TopologySpec(
            instance_id=f"{self.name}-{name}-i{incarnation}",
            role=role,
            tp=tp,
            memory=self._common["memory"],
            transfer_timeout_s=self._common["transfer_timeout_s"],
        )

    def _plan_instance(
        self, role: Role, tp: int, name: str | None = None, peer: TopologySpec | None = None
    ) -> _Instance:
        """An instance's spec and rank configs (its next incarnation, if `name`
        had one). `peer`: its ranks' default pair (None: the first serving
        instance of the other role)."""
        if name is None:
            name = f"{role.value}{next(self._names[role])}"
            while name in self._instances:
                name = f"{role.value}{next(self._names[role])}"
        before = self._instances.get(name)
        incarnation = before.incarnation + 1 if before is not None else 1
        spec = self._spec(role, name, incarnation, tp)
        if peer is None:
            other = self._serving(Role.GEN if role is Role.CTX else Role.CTX)
            if not other:
                raise InstanceUnavailable(f"any {'gen' if role is Role.CTX else 'ctx'} instance", "absent: none to pair with")
            peer = other[0].spec
        configs = rank_configs(
            self.name,
            spec,
            peer,
            self.layout,
            pool_blocks=self.pool_blocks,
            chunk_bytes=self._common["chunk_bytes"],
            lease_timeout_s=self._common["lease_timeout_s"],
            device=self._common["device"],
            fault_plan=self._common["fault_plan"],
            synthetic=self.synthetic,
            frames=self._common["frames"],
            memory_kind=self._memory_kind,
            data_mode="direct",
            coordinator=f"{self.name}.coord.{spec.instance_id}",
            fleet=True,
            admit_at_open=self._admits_at_open(role, tp),
        )
        request = placed(spec, self._gpus_per_rank, *self._steer[role])
        inst = _Instance(
            name=name, role=role, tp=tp, incarnation=incarnation, spec=spec, configs=configs,
            resources=[dict(o) for o in request.actor_options],
        )
        inst.placement = request  # type: ignore[attr-defined]
        self._instances[name] = inst
        self._by_id[spec.instance_id] = inst
        return inst

    def _admits_at_open(self, role: Role, tp: int) -> bool:
        """A CTX instance of one rank admits at the OPEN, unless turned off."""
        return self._admit_at_open and role is Role.CTX and tp == 1

    async def _start_instance(self, inst: _Instance) -> None:
        """Place the instance's group, start its coordinator (which starts the
        ranks), and wait until every rank answered and registered."""
        request = inst.placement  # type: ignore[attr-defined]
        inst.group = create_group(request, f"{inst.id}")
        if not await wait_ready(inst.group, self._placement_timeout_s):
            raise PlacementFailed(
                self.name, inst.role.value, self._placement_timeout_s, request.demand,
                dict(request.label_selector), unplaced_reasons(request, node_views(), {}),
            )
        inst.node = group_node(inst.group)
        for rank, options in enumerate(inst.resources):
            options.update(bundle_strategy(inst.group, rank))
        inst.coord = start_coordinator(
            f"{self.name}.coord.{inst.id}",
            inst.spec,
            _RankFactory(inst.configs, inst.resources),
            options=bundle_strategy(inst.group, 0),
            round_timeout=self._round_timeout_s,
            max_restarts=self._max_restarts,
            restart_timeout=self._start_timeout_s,
            fleet=self.name,
            admits_at_open=self._admits_at_open(inst.role, inst.tp),
            # A GEN instance of one rank admits alone with such a CTX peer.
            admits_alone=self._admit_at_open and inst.role is Role.GEN and inst.tp == 1,
            client_channels=self._common["frames"] == "stream",
        )
        label = f"instance {inst.name}:"
        await await_started(self.name, {label: inst.coord}, {label: inst.id}, self._directory, self._start_timeout_s)

    def _serve(self, inst: _Instance) -> None:
        inst.state = "serving"
        inst.watch = self._spawn(self._watch(inst))

    async def _rank_handles(self, inst: _Instance) -> list[Any]:
        return list(await inst.coord.rank_handles.remote())

    async def _ranks_of(self, insts: list[_Instance]) -> list[Any]:
        """The current rank handles of every instance in `insts`."""
        found = await asyncio.gather(*(self._rank_handles(i) for i in insts))
        return [h for handles in found for h in handles]

    # -- membership -------------------------------------------------------------------

    async def add_instance(self, role: str | Role, tp: int = 1, *, name: str | None = None) -> str:
        """Start an instance and let it serve; returns its logical name. With
        the `name` of an instance that died or left, it is that instance's
        replacement (the next incarnation, a new instance id). Every rank of
        the other role pairs with it (negotiates) before this returns, so the
        first handoff routed to it is not refused; nobody pauses."""
        self._check_open()
        try:
            role = Role(role)
        except ValueError:
            raise InvalidConfig(f"role must be 'ctx' or 'gen', got {short(role)}") from None
        check_int("tp", tp, 1)
        if name is not None:
            if not isinstance(name, str) or not _NAME.match(name):
                raise InvalidConfig(f"instance name must match {_NAME.pattern}, got {short(name)}")
            current = self._instances.get(name)
            if current is not None and current.state not in ("dead", "removed"):
                raise InvalidConfig(f"instance {name!r} exists and is {current.state}: a replacement needs it gone")
            if current is not None and current.role is not role:
                raise InvalidConfig(f"instance {name!r} was a {current.role.value} instance")
        for other in self._serving(Role.GEN if role is Role.CTX else Role.CTX):
            self._check_pair(tp if role is Role.CTX else other.tp, other.tp if role is Role.CTX else tp)
        async with self._membership:
            inst = self._plan_instance(role, tp, name)
            try:
                await self._directory.add_instance.remote(inst.spec, self._memory_kind)
                await self._start_instance(inst)
                ours = await self._rank_handles(inst)
                peers = await self._ranks_of(self._serving(Role.GEN if role is Role.CTX else Role.CTX))
                # Ours learn the table and negotiate with every peer; every peer pairs with us.
                await asyncio.gather(
                    *(h.connect.remote() for h in ours),
                    *(h.peer_joined.remote(inst.spec, self._memory_kind) for h in peers),
                )
            except BaseException:
                await self._remove(inst, "removed")
                raise
            self._serve(inst)
            self.events.append(("join", inst.name, time.monotonic() - self._t0))
        return inst.name

    async def drain(self, name: str, timeout: float = 120.0) -> bool:
        """Drain instance `name`: no new handoff is routed to it and its
        coordinator admits none; the handoffs already in flight finish; then
        it leaves (peers forget it and unload its agents) and its actors stop.
        True when it drained and left within `timeout`; False if handoffs
        were still in flight then (it stays draining: call again)."""
        self._check_open()
        inst = self._named(name)
        if inst.state not in ("serving", "draining"):
            raise InstanceUnavailable(name, inst.state)
        inst.state = "draining"
        if not any(e[:2] == ("drain", name) for e in self.events):
            self.events.append(("drain", name, time.monotonic() - self._t0))

        async def peers() -> list[Any]:
            return await self._ranks_of(self._serving(Role.GEN if inst.role is Role.CTX else Role.CTX))

        if not await drained(inst.coord, inst.id, peers, timeout):
            return False
        await self._remove(inst, "removed")
        return True

    async def _remove(self, inst: _Instance, state: str) -> None:
        """Take `inst` out: the directory forgets it and tells every peer rank
        (`peer_left`), the GEN coordinators drop its handle, its actors stop."""
        inst.state = state
        if inst.watch is not None and inst.watch is not asyncio.current_task():
            inst.watch.cancel()
        gens = [o.coord for o in self._serving(Role.GEN)]
        await take_out(self._directory, inst.id, inst.role, inst.coord, gens, kill_ranks=True)
        if inst.group is not None:
            with contextlib.suppress(Exception):
                remove_group(inst.group)
            inst.group = None

    async def _watch(self, inst: _Instance) -> None:
        """Learn of the coordinator's death at once: `watch` never answers
        while it lives. Then fence the instance and take it out (module
        docstring); a replacement is `add_instance(role, tp, name=...)`."""
        try:
            await inst.coord.watch.remote()
            return  # shut down on purpose
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._closed or inst.state in ("removed", "dead"):
                return
            log.warning("%s: instance %s's coordinator died: %r", self.name, inst.name, exc)
        inst.state = "dead"
        self.events.append(("dead", inst.name, time.monotonic() - self._t0))
        # Its ranks died with it (Ray ends the actors an actor owns). Retire
        # each incarnation: peers end their sessions with it now, and hear
        # `peer_dead` once the directory confirmed the death (their proof).
        epochs = [
            (rank, entry[0].epoch)
            for (entry, _handle) in await self._directory.all_of.remote(inst.id)
            for rank in [entry[0].ns.rank]
        ]
        with contextlib.suppress(Exception):
            await asyncio.gather(*(self._directory.retire.remote(inst.id, rank, epoch) for rank, epoch in epochs))
        await self._remove(inst, "dead")

    # -- routing ------------------------------------------------------------------------

    def _named(self, name: Any) -> _Instance:
        inst = self._instances.get(name) if isinstance(name, str) else None
        if inst is None:
            raise UnknownInstance(str(name)[:80], sorted(self._instances))
        return inst

    def _serving(self, role: Role) -> list[_Instance]:
        return [i for i in self._instances.values() if i.role is role and i.state == "serving"]

    def _choose(self, ctx: str | None, gen: str | None, blocks: int) -> tuple[_Instance, _Instance]:
        """The pair of a handoff: the named instances (checked), or the GEN
        instance with the most free blocks (the client's estimate: its pool
        less what its handoffs in flight lease) and the next CTX instance."""
        picked = []
        for role, name in ((Role.CTX, ctx), (Role.GEN, gen)):
            if name is not None:
                inst = self._named(name)
                if inst.role is not role:
                    raise InstanceUnavailable(name, f"a {inst.role.value} instance, not {role.value}")
                if inst.state != "serving":
                    raise InstanceUnavailable(name, inst.state)
                picked.append(inst)
                continue
            serving = self._serving(role)
            if not serving:
                raise InstanceUnavailable(f"any {role.value} instance", "absent: none serves")
            if role is Role.GEN:
                picked.append(max(serving, key=lambda i: (self.pool_blocks - i.leased, -i.counts["routed"])))
            else:
                picked.append(serving[next(self._rr) % len(serving)])
        c, g = picked
        self._check_pair(c.tp, g.tp)
        return c, g

    async def handoff(  # type: ignore[override]
        self,
        request_id: str,
        num_tokens: int,
        *,
        ctx: str | None = None,
        gen: str | None = None,
        timeout: float = 60.0,
    ) -> HandoffResult:
        """`Deployment.handoff` between CTX instance `ctx` and GEN instance
        `gen` (logical names; None: the chooser picks). Raises
        `UnknownInstance` for a name the fleet never had and
        `InstanceUnavailable` for one that is draining, dead or removed,
        before anything is sent; a handoff already routed to an instance that
        then drains finishes, one to an instance that dies ends "failed"."""
        self._check_open()
        check_timeout(timeout)
        self._checked(request_id, num_tokens)
        blocks = blocks_for_tokens(self.layout, num_tokens)
        c, g = self._choose(ctx, gen, blocks)
        for inst in (c, g):
            inst.leased += blocks
            inst.counts["routed"] += 1
        try:
            result = await self._handoff(request_id, num_tokens, float(timeout), c.id, g.id)
        finally:
            for inst in (c, g):
                inst.leased -= blocks
        self.pair_outcomes[f"{c.name}->{g.name}"][result.outcome] += 1
        return msgspec.structs.replace(result, ctx_instance=c.id, gen_instance=g.id)

    # -- Deployment's hooks, per attempt's pair ----------------------------------------------

    def _trace_coordinators(self) -> list[tuple[Any, str]]:
        # A fleet's admissions always name their peer instance.
        return [(inst.coord, "") for inst in self._by_id.values() if inst.coord is not None]

    def _submit_call(self, attempt: _Attempt) -> Any:
        request = SubmitRequest(attempt.parent, attempt.num_tokens, True, (), attempt.ctx)
        return self._submitter.submit(self._by_id[attempt.gen].coord, request)

    async def _attempt_ranks(self, attempt: _Attempt, role: Role) -> list[Any]:
        inst = self._by_id[attempt.ctx if role is Role.CTX else attempt.gen]
        try:
            return await self._rank_handles(inst)
        except Exception:
            return []  # its coordinator is gone: nothing left to ask

    def _cancel_call(self, attempt: _Attempt | None, parent: ParentKeyLike) -> Any:
        if attempt is not None and attempt.gen:
            return self._by_id[attempt.gen].coord.cancel.remote(parent)
        # An attempt that already ended: every GEN instance forgets nothing it held.
        return asyncio.gather(
            *(i.coord.cancel.remote(parent) for i in self._serving(Role.GEN)), return_exceptions=True
        )

    def _ctx_coordinator(self, attempt: _Attempt | None) -> Any:
        inst = self._by_id.get(attempt.ctx) if attempt is not None and attempt.ctx else None
        return inst.coord if inst is not None else None

    def _gen_tp(self, attempt: _Attempt) -> int:
        return self._by_id[attempt.gen].tp

    # -- views ------------------------------------------------------------------------------

    def instances(self) -> list[dict[str, Any]]:
        """Every instance the fleet had: {id (logical name), instance_id, role,
        tp, incarnation, state, node}; replaced incarnations are not listed."""
        return [
            {
                "id": i.name,
                "instance_id": i.id,
                "role": i.role.value,
                "tp": i.tp,
                "incarnation": i.incarnation,
                "state": i.state,
                "node": i.node,
            }
            for i in self._instances.values()
        ]

    async def instance_ranks(self, name: str) -> list[Any]:
        """The current rank actor handles of instance `name` (rank i at index i)."""
        self._check_open()
        return await self._rank_handles(self._named(name))

    def coordinator_of(self, name: str) -> Any:
        """The coordinator actor of instance `name`."""
        self._check_open()
        return self._named(name).coord

    async def stats(self) -> dict[str, Any]:
        """Every live instance's coordinator stats and every rank's stats (a
        part that does not answer is reported, not raised), plus the fleet's
        instances and per-pair outcomes."""
        self._check_open()
        live = [i for i in self._instances.values() if i.state in ("serving", "draining")]
        coords = await coordinator_stats([(i.name, i.coord) for i in live])
        handles = await asyncio.gather(*(self._rank_handles(i) for i in live), return_exceptions=True)
        ranks = await rank_stats(
            [
                (i.name, i.role, r, h)
                for i, found in zip(live, handles)
                if not isinstance(found, BaseException)
                for r, h in enumerate(found)
            ]
        )
        return {
            "name": self.name,
            "qualified": self.qualified,
            "unqualified_reasons": list(self.unqualified_reasons),
            "control_frames": self.carrier.as_dict() if self.carrier is not None else None,
            "instances": self.instances(),
            "pairs": {k: dict(v) for k, v in self.pair_outcomes.items()},
            "submits": dict(self._submitter.counters),
            "ranks": ranks,
            "coordinators": coords,
        }

    def _coordinators(self) -> list[Any]:
        return [i.coord for i in self._by_id.values() if i.coord is not None]

    async def _teardown(self) -> None:
        insts = list(self._by_id.values())
        for inst in insts:
            if inst.watch is not None:
                inst.watch.cancel()
        await stop_actors(self._coordinators(), self._directory, kill_ranks=True)
        for inst in insts:
            if inst.group is not None:
                with contextlib.suppress(Exception):
                    remove_group(inst.group)
                inst.group = None


ParentKeyLike = Any
