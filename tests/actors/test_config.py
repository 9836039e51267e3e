"""The launch configuration: one typed value, checked in one place (no Ray).

`Deployment.launch` and `Fleet.launch` take a `LaunchConfig` / `FleetConfig`,
keyword fields, or both; every field's constraint and every cross-field rule
is checked by `checked` before anything starts, with an `InvalidConfig`
naming the field. A refused config changes nothing: the base is frozen.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import pytest

from kvhandoff import actors
from kvhandoff.actors import (
    EngineConfig,
    EngineFleetConfig,
    FleetConfig,
    InvalidConfig,
    LaunchConfig,
)
from kvhandoff.actors._config import checked
from kvhandoff.topology import DEFAULT_LAYOUT


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"ctx_tp": 0}, "ctx_tp"),
        ({"gen_tp": -1}, "gen_tp"),
        ({"ctx_tp": True}, "ctx_tp"),
        ({"ctx_tp": "2"}, "ctx_tp"),
        ({"pool_blocks": 0}, "pool_blocks"),
        ({"memory": "HBM"}, "memory"),
        ({"memory_kind": "tiled"}, "memory_kind"),
        ({"round_timeout_s": 0}, "round_timeout_s"),
        ({"start_timeout_s": -1.0}, "start_timeout_s"),
        ({"transfer_timeout_s": -1}, "transfer_timeout_s"),
        ({"gpus_per_rank": 0}, "gpus_per_rank"),
        ({"gpus_per_rank": 1.5}, "gpus_per_rank"),
        ({"gpus_per_rank": True}, "gpus_per_rank"),
        ({"control_frames": "udp"}, "control_frames"),
        ({"data_mode": "bounce"}, "data_mode"),
        ({"staging_window": 0}, "staging_window"),
        ({"staged_below": -1}, "staged_below"),
        ({"placement": "near"}, "placement"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"admit_at_open": True, "ctx_tp": 2}, "admit_at_open"),
        ({"admit_at_open": "yes"}, "admit_at_open"),
        ({"layout": "llama"}, "layout"),
        ({"bogus": 1}, "bogus"),
    ],
    ids=str,
)
def test_each_bad_field_is_refused_by_name(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidConfig, match=named):
        checked(LaunchConfig, **bad)


def test_a_field_with_choices_says_them() -> None:
    with pytest.raises(InvalidConfig) as info:
        checked(LaunchConfig, memory="HBM")
    assert "'DRAM'" in str(info.value) and "'VRAM'" in str(info.value)


def test_fields_replace_the_base_and_the_base_is_unchanged() -> None:
    base = LaunchConfig(ctx_tp=1, gen_tp=2, pool_blocks=32, layout=DEFAULT_LAYOUT)
    cfg = checked(LaunchConfig, base, gen_tp=1, data_mode="direct")
    assert (cfg.ctx_tp, cfg.gen_tp, cfg.pool_blocks, cfg.data_mode) == (1, 1, 32, "direct")
    assert cfg.layout == DEFAULT_LAYOUT
    assert (base.gen_tp, base.data_mode) == (2, "auto")
    with pytest.raises(InvalidConfig, match="pool_blocks"):
        checked(LaunchConfig, base, pool_blocks=0)
    assert base.pool_blocks == 32


def test_a_struct_built_directly_is_checked_again() -> None:
    # msgspec checks constraints only when it converts: the constructor lets 0 through.
    direct = LaunchConfig(ctx_tp=0)
    with pytest.raises(InvalidConfig, match="ctx_tp"):
        checked(LaunchConfig, direct)
    with pytest.raises(InvalidConfig, match="LaunchConfig"):
        checked(LaunchConfig, FleetConfig())  # type: ignore[arg-type]


def test_admit_at_open_follows_ctx_tp_unless_given() -> None:
    assert checked(LaunchConfig, ctx_tp=1).admits_at_open
    assert not checked(LaunchConfig, ctx_tp=2).admits_at_open
    assert not checked(LaunchConfig, ctx_tp=1, admit_at_open=False).admits_at_open


def test_fleet_config_counts_or_lists_instances() -> None:
    assert checked(FleetConfig, ctx=3).tps("ctx") == [1, 1, 1]
    assert checked(FleetConfig, gen=[2, 1]).tps("gen") == [2, 1]
    for bad in ({"ctx": 0}, {"gen": []}, {"ctx": [1, 0]}, {"gen": [True]}, {"ctx": "2"}):
        with pytest.raises(InvalidConfig, match="ctx|gen"):
            checked(FleetConfig, **bad)
    with pytest.raises(InvalidConfig, match="data_mode"):  # a pair's field, not a fleet's
        checked(FleetConfig, data_mode="direct")


def test_the_config_round_trips_as_data() -> None:
    cfg = checked(LaunchConfig, ctx_tp=1, ctx_resources={"ctx_node": 0.01}, layout=DEFAULT_LAYOUT)
    assert msgspec.convert(msgspec.to_builtins(cfg), LaunchConfig) == cfg


def test_launch_takes_a_config_not_an_argument_list() -> None:
    for launch in (actors.Deployment.launch, actors.Fleet.launch):
        params = inspect.signature(launch).parameters
        assert list(params) == ["config", "fault_plan", "fields"], params
        assert params["config"].kind is inspect.Parameter.POSITIONAL_ONLY
        assert params["fault_plan"].kind is inspect.Parameter.KEYWORD_ONLY
    for create in (actors.EngineDeployment.create, actors.EngineFleet.create):
        assert list(inspect.signature(create).parameters) == ["config", "fields"], create


def test_engine_configs_need_a_layout_and_share_the_transfer_fields() -> None:
    with pytest.raises(InvalidConfig, match="needs `layout`"):
        checked(EngineFleetConfig)
    with pytest.raises(InvalidConfig, match="needs `ctx_tp`"):
        checked(EngineConfig, layout=DEFAULT_LAYOUT, gen_tp=1)
    cfg = checked(EngineConfig, layout=DEFAULT_LAYOUT, ctx_tp=2, gen_tp=1, round_timeout_s=2)
    assert (cfg.chunk_bytes, cfg.ctx_memory, cfg.round_timeout_s) == (1 << 20, "paged", 2.0)
    for bad, named in (({"ctx_memory": "x"}, "ctx_memory"), ({"lease_timeout_s": 0}, "lease_timeout_s"),
                       ({"control_frames": "tcp"}, "control_frames"), ({"pool_blocks": 8}, "pool_blocks")):
        with pytest.raises(InvalidConfig, match=named):
            checked(EngineConfig, layout=DEFAULT_LAYOUT, ctx_tp=1, gen_tp=1, **bad)
