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


# -- instances: one placement group each --------------------------------------------------

from kvhandoff.topology import (  # noqa: E402
    HOST_RANK_CPU,
    INSTANCE_STRATEGY,
    NODE_ID_LABEL,
    NodeView,
    label_matches,
    place_instance,
    unplaced_reasons,
)


def test_instance_is_one_strict_pack_bundle_per_rank() -> None:
    s = TopologySpec(instance_id="ctx0", role=Role.CTX, tp=2)
    p = place_instance(s, resources={"ctx_node": 0.01}, labels={"pool": "prefill"})
    assert p.strategy == INSTANCE_STRATEGY == "STRICT_PACK"
    assert p.bundles == ({"CPU": HOST_RANK_CPU, "ctx_node": 0.01},) * 2
    assert p.actor_options == ({"num_cpus": 0},) * 2  # the rank itself asks for no CPU, as before
    assert p.demand == {"CPU": 2 * HOST_RANK_CPU, "ctx_node": 0.02}
    assert p.ray_label_selectors({NODE_ID_LABEL: "!n1"}) == [{"pool": "prefill", NODE_ID_LABEL: "!n1"}] * 2
    p.ray_bundles()[0]["CPU"] = 99  # fresh dicts
    assert p.bundles[0]["CPU"] == HOST_RANK_CPU


def test_vram_bundles_hold_the_gpu_share() -> None:
    s = TopologySpec(instance_id="gen0", role=Role.GEN, tp=4, memory=MemoryKind.VRAM)
    whole = place_instance(s)
    assert whole.bundles == ({"GPU": 1.0},) * 4 and whole.demand == {"GPU": 4.0}
    assert whole.actor_options[0] == {"num_cpus": 0, "num_gpus": 1.0}
    half = place_instance(s, num_ranks=2, gpus_per_rank=0.5)
    assert half.bundles == ({"GPU": 0.5},) * 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_ranks": 0},
        {"gpus_per_rank": 0},
        {"gpus_per_rank": 1.5},
        {"resources": {"GPU": 1}},
        {"resources": {"CPU": 1}},
        {"resources": {"ctx_node": 0}},
        {"resources": {"ctx_node": True}},
        {"resources": ["ctx_node"]},
        {"labels": {"pool": 3}},
        {"labels": {NODE_ID_LABEL: "abc"}},
    ],
)
def test_bad_instance_requests_raise_topology_error(kwargs: dict) -> None:
    with pytest.raises(TopologyError):
        place_instance(TopologySpec(instance_id="c", role=Role.CTX, tp=1), **kwargs)


def test_label_selector_semantics() -> None:
    labels = {"pool": "prefill", NODE_ID_LABEL: "n1"}
    assert label_matches({"pool": "prefill"}, labels)
    assert not label_matches({"pool": "decode"}, labels)
    assert label_matches({"pool": "!decode"}, labels)
    assert label_matches({"zone": "!a"}, labels)  # absent: not equal
    assert label_matches({"pool": "in(decode, prefill)"}, labels)
    assert not label_matches({"pool": "!in(decode,prefill)"}, labels)
    assert not label_matches({NODE_ID_LABEL: "!n1"}, labels)
    assert not label_matches({"zone": "a"}, labels)


def test_unplaced_reasons_name_what_is_missing() -> None:
    gen = place_instance(TopologySpec(instance_id="g", role=Role.GEN, tp=2, memory=MemoryKind.VRAM))
    nodes = [
        NodeView(node_id="a" * 56, resources={"CPU": 8, "GPU": 1}),
        NodeView(node_id="b" * 56, resources={"CPU": 8}),
        NodeView(node_id="c" * 56, alive=False, resources={"GPU": 8}),
    ]
    (why,) = unplaced_reasons(gen, nodes)
    assert "lacks GPU (needs 2, has 1)" in why and "aaaaaaaaaaaa" in why  # the closest alive node
    (why,) = unplaced_reasons(gen, nodes, {NODE_ID_LABEL: "!" + "a" * 56})
    assert "lacks GPU (needs 2, has 0)" in why and "bbbbbbbbbbbb" in why
    (why,) = unplaced_reasons(gen, [NodeView(node_id="d", resources={"GPU": 2})])
    assert "not free" in why  # enough in total: someone else holds it
    ctx = place_instance(TopologySpec(instance_id="c", role=Role.CTX, tp=1), labels={"pool": "prefill"})
    (why,) = unplaced_reasons(ctx, nodes)
    assert "no alive node matches the label selector {'pool': 'prefill'}" in why
    assert unplaced_reasons(ctx, []) == ("the cluster has no alive node",)
