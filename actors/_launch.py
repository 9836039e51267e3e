"""How a `Deployment` starts: plan, place, start (its launch steps).

`Deployment.launch` checks its `LaunchConfig` (actors/_config.py), then
runs these steps, each of which a failure ends with everything it started
stopped by the caller's teardown:

- `_plan`: everything that needs no actor: the two instances' specs, the
  shard map of their TPs, the qualification verdict, one `RankConfig` per
  rank and one placement request per instance (`InvalidConfig`);
- `_place`: one placement group per instance, placed within
  `placement_timeout_s` (`PlacementFailed`), each rank scheduled into its
  bundle;
- `_start`: the directory, both coordinators (which start their ranks), then
  waiting on progress until every rank answered, registered and connected
  (`LaunchFailed`, naming each rank that did not start and why).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ray

from kvhandoff.actors._config import LaunchConfig, staging_of
from kvhandoff.actors._directory import Directory
from kvhandoff.actors._errors import InvalidConfig, PlacementFailed
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors._instance import await_started, connected, start_coordinator
from kvhandoff.actors._placement import (
    bundle_strategy,
    create_group,
    group_node,
    node_views,
    pin,
    wait_ready,
)
from kvhandoff.actors.rank import RankActor, RankConfig
from kvhandoff.protocol import MemoryKind, Role, TopologyError
from kvhandoff.topology import (
    DEFAULT_LAYOUT,
    InstancePlacement,
    KVLayout,
    TopologySpec,
    check_memory_kind,
    place_instance,
    qualify_pair,
    shard_map,
    unplaced_reasons,
)

__all__ = ["Launcher"]

#: One instance's plan: its spec, one config per rank, one set of actor options per rank.
Plan = tuple[TopologySpec, list[RankConfig], list[dict[str, Any]]]


class _RankFactory:
    """Picklable `(rank, epoch) -> handle` for the coordinator (creates and restarts ranks)."""

    def __init__(self, configs: list[RankConfig], resources: list[dict[str, Any]]) -> None:
        self.configs = configs
        self.resources = resources
        self._made: set[int] = set()  # ranks this factory (the coordinator's copy) created

    def __call__(self, rank: int, epoch: int) -> Any:
        handle = RankActor.options(**self.resources[rank]).remote(self.configs[rank], epoch)
        if rank in self._made:
            # A restart: learn the peers' agents and buffers now (calls from one
            # caller run in order: after __init__ registered it), not on the
            # first OPEN. Fire-and-forget; a lookup on first use still covers it.
            handle.connect.remote()
        self._made.add(rank)
        return handle

    def retired(self, rank: int, epoch: int) -> None:
        """The coordinator killed `rank`'s incarnation `epoch`: have the directory
        tell the peer instance's ranks now (fire-and-forget)."""
        config = self.configs[rank]
        directory = ray.get_actor(f"{config.deployment}.directory")
        directory.retire.remote(config.spec.instance_id, rank, epoch)



async def cancel_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel a client handle's background tasks and wait for them to end.
    Tasks of this loop only: a caller that ran earlier calls under another
    loop (asyncio.run per call) had those tasks ended with it."""
    loop = asyncio.get_running_loop()
    live = [t for t in tasks if not t.done() and t.get_loop() is loop]
    for task in live:
        task.cancel()
    await asyncio.gather(*live, return_exceptions=True)


def rank_configs(
    deployment: str, spec: TopologySpec, peer: TopologySpec, layout: KVLayout, **fields: Any
) -> list[RankConfig]:
    """One `RankConfig` per rank of ``spec``, toward ``peer``; ``fields`` are
    the same on every rank."""
    return [
        RankConfig(deployment=deployment, spec=spec, peer_spec=peer, layout=layout, rank=r, **fields)
        for r in range(spec.tp)
    ]


def placed(
    spec: TopologySpec, gpus_per_rank: float, resources: Any, labels: Any
) -> InstancePlacement:
    """``spec``'s placement request: one bundle per rank on one node
    (`place_instance`); a request no node could ever hold is `InvalidConfig`."""
    try:
        return place_instance(
            spec, num_ranks=spec.tp, gpus_per_rank=gpus_per_rank, resources=resources, labels=labels
        )
    except TopologyError as exc:
        raise InvalidConfig(str(exc)) from None


class Launcher:
    """The launch steps of a `Deployment` (a base class of it)."""

    name: str
    ctx_spec: TopologySpec
    gen_spec: TopologySpec
    layout: KVLayout
    qualified: bool
    unqualified_reasons: tuple[str, ...]
    pool_blocks: int
    synthetic: bool
    nodes: dict[Role, str]
    _admit_at_open: bool
    _coords: dict[Role, Any]
    _directory: Any
    _placements: dict[Role, InstancePlacement]
    _groups: dict[Role, Any]

    if TYPE_CHECKING:  # Deployment's

        def _spec(self, role: Role) -> TopologySpec: ...
        async def _all_ranks(self) -> list[Any]: ...

    def _plan(
        self, cfg: LaunchConfig, fault_plan: FaultPlan | None = None
    ) -> list[tuple[TopologySpec, list[RankConfig], list[dict[str, Any]]]]:
        """Everything that needs more than `cfg`'s own checks and no actor:
        the specs, the shard map, the rank configs, the placement requests.
        Raises `InvalidConfig`."""
        self._admit_at_open = cfg.admits_at_open
        mem = MemoryKind(cfg.memory)
        ctx_tp, gen_tp = cfg.ctx_tp, cfg.gen_tp
        self.layout = cfg.layout or DEFAULT_LAYOUT
        self.pool_blocks = cfg.pool_blocks
        self.synthetic = cfg.synthetic
        common = {"memory": mem, "transfer_timeout_s": cfg.transfer_timeout_s}
        try:
            check_memory_kind(cfg.memory_kind)
            self.ctx_spec = TopologySpec(
                instance_id=f"{self.name}-ctx", role=Role.CTX, tp=ctx_tp, **common, **cfg.ctx_overrides
            )
            self.gen_spec = TopologySpec(
                instance_id=f"{self.name}-gen", role=Role.GEN, tp=gen_tp, **common, **cfg.gen_overrides
            )
            # Every edge of the heterogeneous-TP split, as the ranks will build it.
            shard_map(self.layout, ctx_tp, gen_tp)
        except (TopologyError, TypeError, ValueError) as exc:
            raise InvalidConfig(str(exc)) from exc
        verdict = qualify_pair(self.ctx_spec, self.gen_spec)
        self.qualified = verdict.qualified
        self.unqualified_reasons = verdict.reasons
        device = "cuda" if mem is MemoryKind.VRAM else "cpu"
        plans = []
        for spec, peer in ((self.ctx_spec, self.gen_spec), (self.gen_spec, self.ctx_spec)):
            configs = rank_configs(
                self.name,
                spec,
                peer,
                self.layout,
                pool_blocks=cfg.pool_blocks,
                chunk_bytes=cfg.chunk_bytes,
                lease_timeout_s=cfg.lease_timeout_s,
                device=device,
                fault_plan=fault_plan,
                conservative=not self.qualified,
                synthetic=cfg.synthetic,
                prepared_descriptors=cfg.prepared_descriptors,
                frames=cfg.control_frames,
                memory_kind=cfg.memory_kind,
                **staging_of(cfg),
                admit_at_open=self._admit_at_open and spec.role is Role.CTX,
            )
            # One placement group per instance: one bundle per rank actor.
            ctx = spec.role is Role.CTX
            request = placed(
                spec,
                cfg.gpus_per_rank,
                cfg.ctx_resources if ctx else cfg.gen_resources,
                cfg.ctx_labels if ctx else cfg.gen_labels,
            )
            self._placements[spec.role] = request
            resources: list[dict[str, Any]] = [dict(o) for o in request.actor_options]
            plans.append((spec, configs, resources))
        return plans

    async def _place(
        self,
        layout: str,
        timeout_s: float,
        plans: list[tuple[TopologySpec, list[RankConfig], list[dict[str, Any]]]],
    ) -> None:
        """Create each instance's placement group and wait until Ray placed it
        (`pg.ready()`), within `timeout_s` in all; then schedule each rank into
        its bundle (rank i in bundle i, restarts included). CTX goes first:
        for "pack" and "spread" the GEN group is pinned to, or away from, the
        node the CTX group landed on (Ray's `ray.io/node-id` label); for
        "any" both are asked for at once. A group not placed in time raises
        `PlacementFailed` with what the cluster lacks (the caller's teardown
        removes every group)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        order = [Role.CTX, Role.GEN]
        extra: dict[Role, dict[str, str]] = {role: {} for role in order}
        if layout == "any":  # nothing to wait for: ask for both now
            for role in order:
                self._groups[role] = create_group(self._placements[role], f"{self.name}.{role.value}")
        for role in order:
            if role not in self._groups:
                self._groups[role] = create_group(self._placements[role], f"{self.name}.{role.value}", extra[role])
            group = self._groups[role]
            if not await wait_ready(group, deadline - loop.time()):
                request = self._placements[role]
                missing = unplaced_reasons(request, node_views(), extra[role])
                raise PlacementFailed(
                    self.name,
                    role.value,
                    timeout_s,
                    request.demand,
                    {**request.label_selector, **extra[role]},
                    missing,
                )
            self.nodes[role] = group_node(group)
            if role is Role.CTX:
                extra[Role.GEN] = pin(layout, self.nodes[role])
        for spec, _, resources in plans:
            for rank, options in enumerate(resources):
                options.update(bundle_strategy(self._groups[spec.role], rank))

    async def _start(
        self, plans: list[tuple[TopologySpec, list[RankConfig], list[dict[str, Any]]]], cfg: LaunchConfig
    ) -> None:
        """Start the directory and both coordinators over kvhandoff's own rank
        actors (which they start on the first call), then wait until every
        rank answered and registered (actors/_instance.py, the start every
        instance has, an engine's too) and learned its peers."""
        self._directory = Directory.options(name=f"{self.name}.directory").remote(plans[0][1][0].fault_plan)
        for spec, configs, resources in plans:
            # The GEN coordinator drives each handoff: it admits in both
            # instances (the CTX coordinator is its peer) and answers `submit`.
            peer = f"{self.name}.coord.{Role.CTX.value}" if spec.role is Role.GEN else None
            # The coordinator runs beside its ranks (bundle 0: it asks for nothing).
            group = self._groups.get(spec.role)  # none when a caller skipped `_place`
            self._coords[spec.role] = start_coordinator(
                f"{self.name}.coord.{spec.role.value}",
                spec,
                _RankFactory(configs, resources),
                options=bundle_strategy(group, 0) if group is not None else {},
                round_timeout=cfg.round_timeout_s,
                max_restarts=cfg.max_restarts,
                restart_timeout=cfg.start_timeout_s,
                peer=peer,
                admits_at_open=self._admit_at_open and spec.role is Role.CTX,
                # ... and then a GEN instance of one rank admits alone: no round.
                admits_alone=self._admit_at_open and spec.role is Role.GEN and spec.tp == 1,
                client_channels=configs[0].frames == "stream",
            )
        await await_started(
            self.name,
            {role.value: c for role, c in self._coords.items()},
            {role.value: self._spec(role).instance_id for role in self._coords},
            self._directory,
            cfg.start_timeout_s,
        )
        await connected(self.name, await self._all_ranks(), cfg.start_timeout_s)
