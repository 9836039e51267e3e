"""Canonical topology digests: stable, value-based, sensitive to every field."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest

from kvhandoff.protocol import DIGEST_LEN, MemoryKind, Role, TopologyError
from kvhandoff.topology import (
    TOPOLOGY_DIGEST_DOMAIN,
    TopologySpec,
    decode_topology,
    digest_hex,
    encode_topology,
    topology_digest,
)

BASE = TopologySpec(instance_id="ctx0", role=Role.CTX, tp=2)

# Golden values: if one of these changes, the canonical encoding changed, and
# every deployed ticket digest with it. Bump TOPOLOGY_DIGEST_DOMAIN on purpose.
GOLDEN_BASE = "7a7caa67de1adcf5cb5694cd630bcb07725cb17728c92c25f3d403ce25ece4a7"
GOLDEN_VRAM = "a1b3e2f8c018234b8aaba5cf98573e29b2d1090a9672a2c12a2d55dd82c2fde6"
VRAM = TopologySpec(
    instance_id="gen0",
    role=Role.GEN,
    tp=4,
    memory=MemoryKind.VRAM,
    devices=(3, 2, 1, 0),
    transfer_timeout_s=5.0,
)


def test_golden_digests() -> None:
    assert topology_digest(BASE).hex() == GOLDEN_BASE
    assert digest_hex(VRAM) == GOLDEN_VRAM
    assert len(topology_digest(BASE)) == DIGEST_LEN == 32


def test_encoding_starts_with_versioned_domain_and_sorts_keys() -> None:
    blob = encode_topology(BASE)
    assert blob.startswith(TOPOLOGY_DIGEST_DOMAIN)
    body = msgspec.msgpack.decode(blob[len(TOPOLOGY_DIGEST_DOMAIN) :])
    assert list(body) == sorted(msgspec.structs.asdict(BASE))


# One changed value per field; the test below checks the table covers them all.
ONE_FIELD_CHANGES: dict[str, object] = {
    "instance_id": "ctx1",
    "role": Role.GEN,
    "tp": 4,
    "pp": 2,
    "cp": 2,
    "attention_dp": True,
    "layerwise": True,
    "zero_copy": True,
    "overlap": False,
    "transfer_timeout_s": 30.5,
    "backend": "GDS",
    "buffers_preallocated": False,
    "memory": MemoryKind.VRAM,
    "devices": (0, 1),
}


def test_change_table_covers_every_field() -> None:
    assert set(ONE_FIELD_CHANGES) == {f.name for f in msgspec.structs.fields(TopologySpec)}


@pytest.mark.parametrize(("field", "value"), sorted(ONE_FIELD_CHANGES.items()))
def test_changing_any_one_field_changes_the_digest(field: str, value: object) -> None:
    base = BASE
    if field == "devices":  # devices need VRAM; compare against VRAM without devices
        base = msgspec.structs.replace(BASE, memory=MemoryKind.VRAM)
    changed = msgspec.structs.replace(base, **{field: value})
    assert changed != base
    assert topology_digest(changed) != topology_digest(base)


def test_digest_depends_on_value_not_spelling() -> None:
    a = TopologySpec(
        instance_id="x", role="gen", tp=2, memory="VRAM", devices=[0, 1], transfer_timeout_s=7
    )  # type: ignore[arg-type]
    b = TopologySpec(
        instance_id="x",
        role=Role.GEN,
        tp=2,
        memory=MemoryKind.VRAM,
        devices=(0, 1),
        transfer_timeout_s=7.0,
    )
    assert topology_digest(a) == topology_digest(b)
    assert topology_digest(
        TopologySpec(instance_id="x", role=Role.GEN, tp=2, transfer_timeout_s=-0.0)
    ) == topology_digest(TopologySpec(instance_id="x", role=Role.GEN, tp=2, transfer_timeout_s=0.0))


def test_digest_is_stable_across_processes() -> None:
    # A different hash seed in a fresh interpreter: hash() would differ, the digest must not.
    code = (
        "from kvhandoff.topology import TopologySpec, digest_hex;"
        "print(digest_hex(TopologySpec(instance_id='ctx0', role='ctx', tp=2)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == GOLDEN_BASE


def test_encode_decode_round_trip() -> None:
    for s in (BASE, VRAM):
        assert decode_topology(encode_topology(s)) == s
        assert decode_topology(bytearray(encode_topology(s))) == s


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not a topology",
        TOPOLOGY_DIGEST_DOMAIN + b"\xc1",
        TOPOLOGY_DIGEST_DOMAIN + msgspec.msgpack.encode({"instance_id": "a"}),
        TOPOLOGY_DIGEST_DOMAIN
        + msgspec.msgpack.encode({**msgspec.structs.asdict(BASE), "extra": 1}),
        TOPOLOGY_DIGEST_DOMAIN + msgspec.msgpack.encode({**msgspec.structs.asdict(BASE), "tp": 0}),
        TOPOLOGY_DIGEST_DOMAIN + b"\x00" * (64 * 1024),
    ],
)
def test_decode_rejects_bad_input_with_topology_error(blob: bytes) -> None:
    with pytest.raises(TopologyError):
        decode_topology(blob)


def test_bad_arguments() -> None:
    with pytest.raises(TopologyError):
        topology_digest({"tp": 2})  # type: ignore[arg-type]
    with pytest.raises(TopologyError):
        digest_hex(b"short")
    assert digest_hex(topology_digest(BASE)) == GOLDEN_BASE
    with pytest.raises(TopologyError):
        decode_topology("text")  # type: ignore[arg-type]
