"""TopologySpec: every construction path validates and normalizes."""

from __future__ import annotations

import math

import msgspec
import pytest

from kvhandoff.protocol import MemoryKind, ProtocolError, Role, TopologyError
from kvhandoff.topology import (
    MAX_WORLD_SIZE,
    TopologyFieldError,
    TopologySpec,
    make_topology,
    validate_topology,
)


def spec(**overrides: object) -> TopologySpec:
    fields: dict[str, object] = {"instance_id": "ctx0", "role": Role.CTX, "tp": 2}
    fields.update(overrides)
    return TopologySpec(**fields)  # type: ignore[arg-type]


def test_defaults_describe_the_qualified_configuration() -> None:
    s = spec()
    assert (s.pp, s.cp, s.world_size) == (1, 1, 2)
    assert (s.attention_dp, s.layerwise, s.zero_copy, s.overlap) == (False, False, False, True)
    assert (s.backend, s.buffers_preallocated, s.memory, s.devices) == (
        "UCX",
        True,
        MemoryKind.DRAM,
        (),
    )
    assert s.transfer_timeout_s == 30.0


def test_world_size_is_tp_pp_cp() -> None:
    assert spec(tp=4, pp=3, cp=2).world_size == 24


def test_equivalent_spellings_normalize_to_one_value() -> None:
    a = spec(role="ctx", memory="VRAM", devices=[1, 0], transfer_timeout_s=5)
    b = spec(role=Role.CTX, memory=MemoryKind.VRAM, devices=(1, 0), transfer_timeout_s=5.0)
    assert a == b
    assert hash(a) == hash(b)  # devices became a tuple, so the spec hashes
    assert a.role is Role.CTX and a.memory is MemoryKind.VRAM
    assert isinstance(a.devices, tuple)
    assert type(a.transfer_timeout_s) is float
    z = spec(transfer_timeout_s=-0.0)
    assert math.copysign(1.0, z.transfer_timeout_s) == 1.0


BAD_FIELDS = [
    ("instance_id", ""),
    ("instance_id", "has space"),
    ("instance_id", "x" * 129),
    ("instance_id", 7),
    ("role", "prefill"),
    ("tp", 0),
    ("tp", -1),
    ("tp", 1025),
    ("tp", True),
    ("tp", 2.0),
    ("pp", 0),
    ("cp", 0),
    ("attention_dp", 1),
    ("layerwise", "no"),
    ("zero_copy", None),
    ("overlap", 0),
    ("buffers_preallocated", "yes"),
    ("transfer_timeout_s", -1.0),
    ("transfer_timeout_s", math.inf),
    ("transfer_timeout_s", math.nan),
    ("transfer_timeout_s", 1e9),
    ("transfer_timeout_s", "5"),
    ("transfer_timeout_s", True),
    ("backend", ""),
    ("backend", "U C X"),
    ("backend", "X" * 33),
    ("memory", "HBM"),
    ("devices", "01"),
    ("devices", 3),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_bad_field_raises_typed_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(TopologyFieldError) as info:
        spec(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, TopologyError) and isinstance(info.value, ProtocolError)
    assert field in str(info.value)


def test_world_size_is_bounded() -> None:
    with pytest.raises(TopologyFieldError, match="world size"):
        spec(tp=64, pp=64, cp=2)
    assert spec(tp=64, pp=64).world_size == MAX_WORLD_SIZE


@pytest.mark.parametrize(
    ("memory", "devices", "problem"),
    [
        ("DRAM", (0, 1), "empty for DRAM"),
        ("VRAM", (0,), "one id per rank"),
        ("VRAM", (0, 1, 2), "one id per rank"),
        ("VRAM", (1, 1), "two ranks on one device"),
        ("VRAM", (0, -1), "must be in"),
        ("VRAM", (0, 1024), "must be in"),
        ("VRAM", (0, True), "must be an int"),
    ],
)
def test_device_rules(memory: str, devices: tuple[int, ...], problem: str) -> None:
    with pytest.raises(TopologyFieldError, match=problem) as info:
        spec(memory=memory, devices=devices)
    assert info.value.field == "devices"


def test_vram_devices_empty_or_one_per_rank() -> None:
    assert spec(memory="VRAM").devices == ()
    assert spec(memory="VRAM", tp=2, pp=2, devices=[3, 2, 1, 0]).devices == (3, 2, 1, 0)


def test_replace_and_convert_are_validated_too() -> None:
    s = spec()
    with pytest.raises(TopologyFieldError):
        msgspec.structs.replace(s, tp=0)
    with pytest.raises(TopologyFieldError):
        msgspec.convert(
            {"instance_id": "a", "role": "ctx", "tp": 2, "devices": [0, 1]}, TopologySpec
        )


def test_spec_is_frozen() -> None:
    s = spec()
    with pytest.raises(AttributeError):
        s.tp = 4  # type: ignore[misc]


def test_make_topology_turns_missing_and_unknown_fields_into_topology_error() -> None:
    assert make_topology(instance_id="g", role="gen", tp=1).role is Role.GEN
    with pytest.raises(TopologyError, match="bad topology fields"):
        make_topology(instance_id="g", role="gen")
    with pytest.raises(TopologyError, match="bad topology fields"):
        make_topology(instance_id="g", role="gen", tp=1, colour="blue")
    with pytest.raises(TopologyFieldError):
        make_topology(instance_id="g", role="gen", tp=0)


def test_validate_topology() -> None:
    s = spec()
    assert validate_topology(s) is s
    with pytest.raises(TopologyError, match="expected a TopologySpec"):
        validate_topology({"tp": 2})
    # Mutated behind msgspec's back: caught at the trust boundary.
    msgspec.structs.force_setattr(s, "tp", 0)
    with pytest.raises(TopologyFieldError):
        validate_topology(s)
