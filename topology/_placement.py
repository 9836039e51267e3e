"""Placement: which device each rank of a topology uses, and what to ask Ray for.

One Ray actor per rank (docs/design.md intro). A VRAM topology needs one GPU per
rank: either the ranks named in `spec.devices`, or, when that is empty, GPU
`i` for rank `i`. A DRAM topology needs no GPU and asks Ray for no CPU either:
rank actors mostly wait on the control plane and on NIXL, and a 2-core
machine must still fit a CTX and a GEN instance.

`Placement.device` is the GPU's index among the GPUs the deployment may use
(for logs, and for runs without Ray's GPU isolation). Under Ray's
`num_gpus=1` the actor sees only its own GPU, as `cuda:0`; which physical GPU
that is remains Ray's choice.

`place_instance` is the instance-level request a deployment makes: one Ray
placement group per instance, one bundle per rank, STRICT_PACK (the ranks of
an instance share a node), with custom resources and node labels that steer
it to a kind of node; `unplaced_reasons` says, from a snapshot of the nodes,
what a group that Ray could not place is missing (docs/design.md "Placement").
"""

from __future__ import annotations

import msgspec

from kvhandoff.protocol import MemoryKind, RankNamespace, Role, TopologyError

from ._spec import TopologySpec

__all__ = [
    "Placement",
    "PlacementError",
    "place",
    "InstancePlacement",
    "place_instance",
    "INSTANCE_LAYOUTS",
    "INSTANCE_STRATEGY",
    "HOST_RANK_CPU",
    "NODE_ID_LABEL",
    "NodeView",
    "label_matches",
    "unplaced_reasons",
]


class PlacementError(TopologyError):
    """A VRAM topology needs more GPUs than are available. Carries `needed`
    (the GPU count the placement needs) and `available`."""

    def __init__(self, instance_id: str, needed: int, available: int) -> None:
        super().__init__(
            f"topology {instance_id!r} needs {needed} GPU(s), only {available} available"
        )
        self.instance_id = instance_id
        self.needed = needed
        self.available = available


class Placement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where one rank runs: its namespace, its memory kind, its GPU (None for
    host memory) and the Ray resources its actor requests."""

    ns: RankNamespace
    memory: MemoryKind
    device: int | None
    num_gpus: int
    num_cpus: int = 0

    @property
    def rank(self) -> int:
        """The rank within its instance."""
        return self.ns.rank

    @property
    def ray_resources(self) -> dict[str, int]:
        """Keyword arguments for `ActorClass.options(...)`, e.g.
        `{"num_cpus": 0, "num_gpus": 1}`; a fresh dict on every call."""
        resources = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            resources["num_gpus"] = self.num_gpus
        return resources


def place(spec: TopologySpec, num_gpus_available: int) -> tuple[Placement, ...]:
    """Place every rank of `spec`, in rank order.

    `num_gpus_available` is how many GPUs the deployment may use (indices
    `0 .. num_gpus_available - 1`). Raises `PlacementError` when a VRAM
    topology needs a GPU index it does not have.
    """
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")
    if (
        not isinstance(num_gpus_available, int)
        or isinstance(num_gpus_available, bool)
        or num_gpus_available < 0
    ):
        raise TopologyError(f"num_gpus_available must be an int >= 0, got {num_gpus_available!r}")

    def ns(rank: int) -> RankNamespace:
        return RankNamespace(instance_id=spec.instance_id, role=spec.role, rank=rank)

    if spec.memory is MemoryKind.DRAM:
        return tuple(
            Placement(ns=ns(r), memory=spec.memory, device=None, num_gpus=0)
            for r in range(spec.world_size)
        )

    devices = spec.devices or tuple(range(spec.world_size))
    # Devices are distinct (the spec checks), so the highest index decides.
    needed = max(devices) + 1
    if needed > num_gpus_available:
        raise PlacementError(spec.instance_id, needed, num_gpus_available)
    return tuple(
        Placement(ns=ns(r), memory=spec.memory, device=d, num_gpus=1) for r, d in enumerate(devices)
    )


# -- instances: one Ray placement group each ------------------------------------------
#
# A deployment asks Ray for one placement group per instance: one bundle per
# rank (rank i in bundle i), STRICT_PACK, so an instance's ranks share a node
# (and its NVLink / shared memory) and a rank restarted by its coordinator
# comes back into the same bundle, on the same node. Where the two instances
# go relative to each other (`INSTANCE_LAYOUTS`) is decided by the actors
# layer, which knows where the first one landed; this module only builds the
# request and explains a refusal, from data the caller reads off the cluster.

#: How the CTX and the GEN instance sit relative to each other: "any" (Ray
#: picks each instance's node; they may share one), "pack" (both on one node),
#: "spread" (on two different nodes).
INSTANCE_LAYOUTS = ("any", "pack", "spread")

#: Every bundle of an instance lands on one node.
INSTANCE_STRATEGY = "STRICT_PACK"

#: What a host-memory rank's bundle reserves. Ray refuses an empty bundle, and
#: a rank actor asks for no CPU (see the module docstring), so its bundle
#: holds a hundredth of a CPU: a 2-core host still fits hundreds of ranks,
#: while a node started with `--num-cpus=0` (a head kept free of work) gets none.
HOST_RANK_CPU = 0.01

# The node-id label Ray gives every node (`ray.io/node-id`): how the actors
# layer pins the second instance to (or away from) the first one's node.
NODE_ID_LABEL = "ray.io/node-id"


class InstancePlacement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one instance asks Ray for: a placement group of one bundle per
    rank (`bundles[i]` holds rank i), placed with `strategy`, every bundle on
    a node whose labels match `label_selector`; rank i's actor then asks for
    `actor_options[i]` (keyword arguments for `ActorClass.options`) inside
    its bundle."""

    instance_id: str
    role: Role
    strategy: str
    bundles: tuple[dict[str, float], ...]
    label_selector: dict[str, str]
    actor_options: tuple[dict[str, float], ...]

    @property
    def demand(self) -> dict[str, float]:
        """What the one node that holds the instance must have: every bundle added up."""
        total: dict[str, float] = {}
        for bundle in self.bundles:
            for resource, amount in bundle.items():
                total[resource] = total.get(resource, 0.0) + amount
        return total

    def ray_bundles(self) -> list[dict[str, float]]:
        """Fresh bundle dicts for `ray.util.placement_group`."""
        return [dict(b) for b in self.bundles]

    def ray_label_selectors(self, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
        """One label selector per bundle (`bundle_label_selector`), with `extra` added."""
        return [{**self.label_selector, **(extra or {})} for _ in self.bundles]


def place_instance(
    spec: TopologySpec,
    *,
    num_ranks: int | None = None,
    gpus_per_rank: float = 1.0,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
) -> InstancePlacement:
    """The placement group request of one instance.

    `num_ranks` rank actors (default `spec.world_size`); each rank's bundle
    holds `gpus_per_rank` GPU for VRAM (a fraction lets ranks share a GPU, as
    without placement groups) or `HOST_RANK_CPU` for DRAM, plus `resources`
    (custom resources every rank's bundle reserves, e.g. `{"ctx_node": 0.01}`:
    only nodes started with them qualify); `labels` is a Ray label selector
    every bundle's node must match (e.g. `{"kvhandoff-role": "ctx"}` for
    nodes started with `--labels`). Raises `TopologyError` on bad input.
    """
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")
    count = spec.world_size if num_ranks is None else num_ranks
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise TopologyError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if (
        not isinstance(gpus_per_rank, int | float)
        or isinstance(gpus_per_rank, bool)
        or not gpus_per_rank > 0
        or (gpus_per_rank > 1 and gpus_per_rank != int(gpus_per_rank))
    ):
        raise TopologyError(f"gpus_per_rank must be a fraction in (0, 1] or a whole number, got {gpus_per_rank!r}")
    extra = _resources(spec.role, resources)
    selector = _labels(spec.role, labels)
    if spec.memory is MemoryKind.VRAM:
        own: dict[str, float] = {"GPU": float(gpus_per_rank)}
        options: dict[str, float] = {"num_cpus": 0, "num_gpus": float(gpus_per_rank)}
    else:
        own, options = {"CPU": HOST_RANK_CPU}, {"num_cpus": 0}
    for name in extra:
        if name in own:
            raise TopologyError(f"{spec.role.value} resources: {name!r} is the rank's own resource, set by the memory kind")
    bundle = {**own, **extra}
    return InstancePlacement(
        instance_id=spec.instance_id,
        role=spec.role,
        strategy=INSTANCE_STRATEGY,
        bundles=tuple(dict(bundle) for _ in range(count)),
        label_selector=selector,
        actor_options=tuple(dict(options) for _ in range(count)),
    )


def _resources(role: Role, resources: dict[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, dict):
        raise TopologyError(f"{role.value} resources must be a dict of name -> amount, got {resources!r}")
    found: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name or name in ("GPU", "CPU", "memory", "object_store_memory"):
            raise TopologyError(
                f"{role.value} resources: {name!r} is not a custom resource name (GPU and CPU follow the memory kind)"
            )
        if not isinstance(amount, int | float) or isinstance(amount, bool) or not amount > 0:
            raise TopologyError(f"{role.value} resources: {name!r} needs a positive amount, got {amount!r}")
        found[name] = float(amount)
    return found


def _labels(role: Role, labels: dict[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in labels.items()):
        raise TopologyError(f"{role.value} labels must be a dict of label -> selector strings, got {labels!r}")
    if NODE_ID_LABEL in labels:
        raise TopologyError(f"{role.value} labels: {NODE_ID_LABEL!r} is set by the placement (pack/spread), not by hand")
    return dict(labels)


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """One node as the caller read it off the cluster: its id, whether it is
    alive, its total resources and its labels."""

    node_id: str
    alive: bool = True
    resources: dict[str, float] = {}
    labels: dict[str, str] = {}


def label_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a node with `labels` matches a Ray label selector: "v" (equal),
    "!v" (absent or different), "in(a,b)" and "!in(a,b)"."""
    for key, want in selector.items():
        negate = want.startswith("!")
        want = want[1:] if negate else want
        if want.startswith("in(") and want.endswith(")"):
            choices = {c.strip() for c in want[3:-1].split(",")}
        else:
            choices = {want}
        hit = key in labels and labels[key] in choices
        if hit == negate:
            return False
    return True


def unplaced_reasons(
    placement: InstancePlacement, nodes: list[NodeView], extra_selector: dict[str, str] | None = None
) -> tuple[str, ...]:
    """Why `placement` (with `extra_selector` added to its labels) may not be
    placed on `nodes`: what the closest node lacks, or that no node matches
    the labels, or that some node has it all in total but it is held by other
    work. One line per reason, for an error message."""
    selector = {**placement.label_selector, **(extra_selector or {})}
    demand = placement.demand
    alive = [n for n in nodes if n.alive]
    if not alive:
        return ("the cluster has no alive node",)
    # Ray labels every node with its id; a snapshot may leave that out.
    matching = [n for n in alive if label_matches(selector, {NODE_ID_LABEL: n.node_id, **n.labels})]
    if not matching:
        return (f"no alive node matches the label selector {selector} ({len(alive)} alive node(s))",)
    closest: tuple[float, NodeView, dict[str, tuple[float, float]]] | None = None
    for node in matching:
        short = {
            r: (need, node.resources.get(r, 0.0))
            for r, need in demand.items()
            if node.resources.get(r, 0.0) + 1e-9 < need
        }
        if not short:
            return (
                f"node {node.node_id[:12]} has {_fmt(demand)} in total, but not free: "
                "other placement groups or actors hold it",
            )
        gap = sum(need - have for need, have in short.values())
        if closest is None or (len(short), gap) < (len(closest[2]), closest[0]):
            closest = (gap, node, short)
    assert closest is not None
    _, node, short = closest
    lacks = ", ".join(f"{r} (needs {_num(need)}, has {_num(have)})" for r, (need, have) in sorted(short.items()))
    where = f" matching {selector}" if selector else ""
    return (
        f"no node{where} holds {_fmt(demand)} for {len(placement.bundles)} rank(s) {placement.strategy}; "
        f"the closest, node {node.node_id[:12]}, lacks {lacks}",
    )


def _num(x: float) -> str:
    return f"{x:g}"


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(resources.items())) + "}"
