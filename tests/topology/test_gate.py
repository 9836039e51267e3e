"""The qualified-scope gate: qualified iff every docs/design.md condition holds, one reason per failure."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import Role, TopologyError
from kvhandoff.topology import Qualification, TopologySpec, qualify, qualify_pair

CTX = TopologySpec(instance_id="ctx0", role=Role.CTX, tp=2)
GEN = TopologySpec(instance_id="gen0", role=Role.GEN, tp=4)

# Each row breaks exactly one condition, with a word its reason must contain.
BREAKERS: list[tuple[dict[str, object], str]] = [
    ({"backend": "GDS"}, "backend"),
    ({"buffers_preallocated": False}, "preallocated"),
    ({"transfer_timeout_s": 0.0}, "timeout"),
    ({"overlap": False}, "overlap"),
    ({"pp": 2}, "pipeline"),
    ({"cp": 2}, "context parallelism"),
    ({"attention_dp": True}, "attention data parallelism"),
    ({"layerwise": True}, "layerwise"),
    ({"zero_copy": True}, "zero-copy"),
]


def test_default_spec_is_qualified() -> None:
    q = qualify(CTX)
    assert q.qualified and q.reasons == ()


@pytest.mark.parametrize(("change", "word"), BREAKERS)
def test_each_failing_condition_gives_its_own_reason(change: dict[str, object], word: str) -> None:
    q = qualify(msgspec.structs.replace(CTX, **change))
    assert not q.qualified
    assert len(q.reasons) == 1
    assert word in q.reasons[0]


def test_all_failures_are_reported_in_table_order() -> None:
    everything: dict[str, object] = {}
    for change, _ in BREAKERS:
        everything.update(change)
    q = qualify(msgspec.structs.replace(CTX, **everything))
    assert len(q.reasons) == len(BREAKERS)
    for reason, (_, word) in zip(q.reasons, BREAKERS, strict=True):
        assert word in reason


@settings(max_examples=200, deadline=None)
@given(
    backend=st.sampled_from(["UCX", "GDS", "ucx", "LIBFABRIC"]),
    prealloc=st.booleans(),
    timeout=st.sampled_from([0.0, 1e-6, 30.0]),
    overlap=st.booleans(),
    pp=st.integers(1, 3),
    cp=st.integers(1, 3),
    adp=st.booleans(),
    layerwise=st.booleans(),
    zero_copy=st.booleans(),
)
def test_qualified_iff_model_says_so(
    backend: str,
    prealloc: bool,
    timeout: float,
    overlap: bool,
    pp: int,
    cp: int,
    adp: bool,
    layerwise: bool,
    zero_copy: bool,
) -> None:
    s = TopologySpec(
        instance_id="i", role=Role.GEN, tp=1, pp=pp, cp=cp, attention_dp=adp, layerwise=layerwise,
        zero_copy=zero_copy, overlap=overlap, transfer_timeout_s=timeout, backend=backend,
        buffers_preallocated=prealloc,
    )
    failures = [
        backend != "UCX",
        not prealloc,
        timeout <= 0,
        not overlap,
        pp != 1,
        cp != 1,
        adp,
        layerwise,
        zero_copy,
    ]
    q = qualify(s)
    assert q.qualified == (not any(failures))
    assert len(q.reasons) == sum(failures)


def test_qualification_cannot_be_qualified_with_reasons() -> None:
    assert not Qualification(reasons=("x",)).qualified
    assert Qualification().qualified


def test_pair_prefixes_reasons_by_side() -> None:
    assert qualify_pair(CTX, GEN).qualified
    q = qualify_pair(
        msgspec.structs.replace(CTX, pp=2),
        msgspec.structs.replace(GEN, zero_copy=True, overlap=False),
    )
    assert not q.qualified
    assert len(q.reasons) == 3
    assert q.reasons[0].startswith("ctx: ") and "pipeline" in q.reasons[0]
    assert all(r.startswith("gen: ") for r in q.reasons[1:])


def test_pair_rejects_swapped_roles() -> None:
    with pytest.raises(TopologyError, match="ctx_spec"):
        qualify_pair(GEN, GEN)
    with pytest.raises(TopologyError, match="gen_spec"):
        qualify_pair(CTX, CTX)
    with pytest.raises(TopologyError):
        qualify("not a spec")  # type: ignore[arg-type]
