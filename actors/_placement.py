"""Placement groups for a deployment's instances (docs/design.md "Placement").

`topology.place_instance` builds each instance's request (pure); this module
is the Ray side of it: create the placement group, wait on `pg.ready()`
within a bound, find the node it landed on, read the cluster's nodes to
explain a group that was not placed, remove groups. It decides nothing:
`Deployment` orders the calls (the second instance of a "pack" or "spread"
layout is pinned by node id once the first one is placed) and raises its
typed errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvhandoff.topology import NODE_ID_LABEL, InstancePlacement, NodeView

__all__ = ["create_group", "wait_ready", "group_node", "node_views", "remove_group", "bundle_strategy", "pin"]


def pin(layout: str, first_node: str) -> dict[str, str]:
    """The label selector that puts the second instance relative to the first
    one's node: on it ("pack"), away from it ("spread"), anywhere ("any")."""
    if layout == "pack":
        return {NODE_ID_LABEL: first_node}
    if layout == "spread":
        return {NODE_ID_LABEL: f"!{first_node}"}
    return {}


def create_group(request: InstancePlacement, name: str, extra_selector: dict[str, str] | None = None) -> PlacementGroup:
    """Ask Ray for `request`'s placement group (returns at once; not placed yet)."""
    selectors = request.ray_label_selectors(extra_selector)
    return placement_group(
        request.ray_bundles(),
        strategy=request.strategy,
        name=name,
        bundle_label_selector=selectors if any(selectors) else None,
    )


async def wait_ready(group: PlacementGroup, timeout_s: float) -> bool:
    """Whether `group` was placed within `timeout_s` (awaits `pg.ready()`)."""

    async def ready() -> None:
        await group.ready()

    try:
        await asyncio.wait_for(ready(), max(timeout_s, 0.0))
    except TimeoutError:
        return False
    return True


def group_node(group: PlacementGroup) -> str:
    """The node id (hex) of a placed STRICT_PACK group: every bundle's node."""
    nodes = set(placement_group_table(group)["bundles_to_node_id"].values())
    if len(nodes) != 1:  # STRICT_PACK guarantees one; say so loudly if not
        raise RuntimeError(f"placement group {group.id.hex()} spans nodes {sorted(nodes)}")
    return str(nodes.pop())


def node_views() -> list[NodeView]:
    """The cluster's nodes as `unplaced_reasons` reads them (total resources, labels)."""
    return [
        NodeView(
            node_id=str(n.get("NodeID", "")),
            alive=bool(n.get("Alive", False)),
            resources={k: float(v) for k, v in (n.get("Resources") or {}).items()},
            labels={str(k): str(v) for k, v in (n.get("Labels") or {}).items()},
        )
        for n in ray.nodes()
    ]


def remove_group(group: PlacementGroup) -> None:
    """Remove a group (placed or still pending); its actors end with it."""
    remove_placement_group(group)


def bundle_strategy(group: PlacementGroup, bundle: int) -> dict[str, Any]:
    """`ActorClass.options(...)` keywords that schedule an actor into `bundle` of `group`."""
    return {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False,
        )
    }
