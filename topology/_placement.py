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
"""

from __future__ import annotations

import msgspec

from kvhandoff.protocol import MemoryKind, RankNamespace, TopologyError

from ._spec import TopologySpec

__all__ = ["Placement", "PlacementError", "place"]


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
