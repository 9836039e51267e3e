"""Placement: one device (or host) and one Ray resource request per rank."""

from __future__ import annotations

import pytest

from kvhandoff.protocol import MemoryKind, RankNamespace, Role, TopologyError
from kvhandoff.topology import PlacementError, TopologySpec, place


def test_dram_ranks_go_to_host_and_ask_for_nothing() -> None:
    s = TopologySpec(instance_id="ctx0", role=Role.CTX, tp=2, pp=2)
    ps = place(s, 0)
    assert [p.rank for p in ps] == [0, 1, 2, 3]
    assert all(p.device is None and p.memory is MemoryKind.DRAM for p in ps)
    assert all(p.ray_resources == {"num_cpus": 0} for p in ps)
    assert ps[3].ns == RankNamespace(instance_id="ctx0", role=Role.CTX, rank=3)


def test_vram_without_devices_takes_gpu_i_for_rank_i() -> None:
    s = TopologySpec(instance_id="gen0", role=Role.GEN, tp=4, memory=MemoryKind.VRAM)
    ps = place(s, 8)
    assert [p.device for p in ps] == [0, 1, 2, 3]
    assert all(p.ray_resources == {"num_cpus": 0, "num_gpus": 1} for p in ps)


def test_vram_with_devices_follows_the_spec() -> None:
    s = TopologySpec(
        instance_id="gen0", role=Role.GEN, tp=2, memory=MemoryKind.VRAM, devices=(5, 2)
    )
    assert [p.device for p in place(s, 6)] == [5, 2]


def test_not_enough_gpus_raises_placement_error() -> None:
    s = TopologySpec(instance_id="gen0", role=Role.GEN, tp=4, memory=MemoryKind.VRAM)
    with pytest.raises(PlacementError) as info:
        place(s, 3)
    assert (info.value.needed, info.value.available) == (4, 3)
    assert isinstance(info.value, TopologyError)
    pinned = TopologySpec(
        instance_id="gen0", role=Role.GEN, tp=2, memory=MemoryKind.VRAM, devices=(0, 7)
    )
    with pytest.raises(PlacementError) as info:
        place(pinned, 4)
    assert info.value.needed == 8


def test_ray_resources_is_a_fresh_dict() -> None:
    p = place(TopologySpec(instance_id="c", role=Role.CTX, tp=1), 0)[0]
    p.ray_resources["num_cpus"] = 99
    assert p.ray_resources == {"num_cpus": 0}


@pytest.mark.parametrize("bad", [-1, True, 1.0, None])
def test_bad_gpu_count(bad: object) -> None:
    with pytest.raises(TopologyError):
        place(TopologySpec(instance_id="c", role=Role.CTX, tp=1), bad)  # type: ignore[arg-type]
    with pytest.raises(TopologyError):
        place("spec", 1)  # type: ignore[arg-type]
