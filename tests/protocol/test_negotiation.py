"""Negotiation: deterministic, order-independent, and refuses any disagreement."""

from __future__ import annotations

import functools
import operator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    ABI_MSGPACK_V1,
    ALL_CAPABILITIES,
    DEFAULT_DESCRIPTOR,
    LOCAL_ABI,
    SUPPORTED_VERSIONS,
    AbiMismatchError,
    Capability,
    CapabilityMissingError,
    Negotiated,
    NegotiationError,
    RankDescriptorV1,
    RankDescriptorV2,
    VersionMismatchError,
    allowed_kinds,
    decode_frame,
    encode_frame,
    local_descriptor,
    negotiate,
    require,
)
from tests.protocol import strategies as s

V1_CAPS = Capability.OPEN_CARRIES_BUFFER_INFO | Capability.CHUNKED_WRITE | Capability.STAGED_WRITE
ALL = int(ALL_CAPABILITIES)


def v1(version: int = 1, caps: int = ALL) -> RankDescriptorV1:
    return RankDescriptorV1(version=version, capabilities=caps)


def v2(
    versions: list[int] | None = None, caps: int = ALL, abi: str = ABI_MSGPACK_V1
) -> RankDescriptorV2:
    return RankDescriptorV2(
        versions=[1, 2] if versions is None else versions, capabilities=caps, abi=abi
    )


# A topology of 1..8 ranks whose descriptors mostly agree but sometimes do not:
# versions from 1..3 (3 is one this build does not speak), a small set of ABIs.
_topologies = st.lists(
    s.descriptors(
        versions=st.integers(min_value=1, max_value=3),
        abis=st.sampled_from([ABI_MSGPACK_V1, ABI_MSGPACK_V1, ABI_MSGPACK_V1, "msgpack-v2"]),
    ),
    min_size=1,
    max_size=8,
)


def _outcome(descriptors: list[RankDescriptorV1 | RankDescriptorV2]) -> Negotiated | type:
    try:
        return negotiate(descriptors)
    except NegotiationError as exc:
        return type(exc)


def _model(descriptors: list[RankDescriptorV1 | RankDescriptorV2]) -> Negotiated | type:
    # A plain restatement of the rules, to compare against.
    offers = [
        ({d.version}, d.capabilities, ABI_MSGPACK_V1)
        if isinstance(d, RankDescriptorV1)
        else (set(d.versions), d.capabilities, d.abi)
        for d in descriptors
    ]
    if len({abi for _, _, abi in offers}) != 1 or offers[0][2] != ABI_MSGPACK_V1:
        return AbiMismatchError
    common = set(SUPPORTED_VERSIONS)
    for versions, _, _ in offers:
        common &= versions
    if not common:
        return VersionMismatchError
    version = max(common)
    caps = functools.reduce(operator.and_, (c for _, c, _ in offers)) & ALL
    if version == 1:
        caps &= int(V1_CAPS)
    return Negotiated(version=version, capabilities=Capability(caps), abi=ABI_MSGPACK_V1)


@settings(max_examples=300, deadline=None)
@given(_topologies, st.data())
def test_permutation_invariance_and_model(
    descriptors: list[RankDescriptorV1 | RankDescriptorV2], data: st.DataObject
) -> None:
    expected = _outcome(descriptors)
    assert expected == _model(descriptors)
    shuffled = data.draw(st.permutations(descriptors))
    assert _outcome(shuffled) == expected
    # Duplicating a rank's descriptor changes nothing: only the set matters.
    assert _outcome([*descriptors, descriptors[0]]) == expected


@settings(max_examples=100, deadline=None)
@given(_topologies)
def test_result_is_self_consistent(descriptors: list[RankDescriptorV1 | RankDescriptorV2]) -> None:
    outcome = _outcome(descriptors)
    if not isinstance(outcome, Negotiated):
        return
    assert outcome.version in SUPPORTED_VERSIONS
    assert outcome.abi == LOCAL_ABI
    assert outcome.capabilities & ~ALL_CAPABILITIES == 0
    # A negotiated capability never needs a message its version cannot carry.
    if outcome.supports(Capability.TERMINAL_V1) or outcome.supports(Capability.INFLIGHT_CANCEL):
        assert "terminal" in allowed_kinds(outcome.version)
    # Every rank offered the chosen version and every negotiated bit.
    for d in descriptors:
        offered = [d.version] if isinstance(d, RankDescriptorV1) else d.versions
        assert outcome.version in offered
        assert outcome.capabilities & d.capabilities == outcome.capabilities


def test_local_descriptor_negotiates_everything() -> None:
    assert local_descriptor() == DEFAULT_DESCRIPTOR
    assert local_descriptor() is not local_descriptor()
    assert DEFAULT_DESCRIPTOR.versions == list(SUPPORTED_VERSIONS)
    assert DEFAULT_DESCRIPTOR.abi == LOCAL_ABI == ABI_MSGPACK_V1
    got = negotiate([local_descriptor(), local_descriptor()])
    assert got == Negotiated(version=2, capabilities=ALL_CAPABILITIES, abi=ABI_MSGPACK_V1)
    require(got, *Capability)


def test_highest_common_version_and_capability_intersection() -> None:
    got = negotiate(
        [
            v2(
                [1, 2],
                caps=Capability.INFLIGHT_CANCEL | Capability.TERMINAL_V1 | Capability.CHUNKED_WRITE,
            ),
            v2(
                [2, 1],
                caps=Capability.INFLIGHT_CANCEL
                | Capability.CHUNKED_WRITE
                | Capability.STAGED_WRITE,
            ),
        ]
    )
    assert got.version == 2
    assert got.capabilities == Capability.INFLIGHT_CANCEL | Capability.CHUNKED_WRITE
    assert got.supports(Capability.CHUNKED_WRITE)
    assert not got.supports(Capability.TERMINAL_V1)


def test_v1_and_v2_mix_settles_on_v1_without_inflight_cancel() -> None:
    for topology in ([local_descriptor(), v1()], [v1(), local_descriptor()]):
        got = negotiate(topology)
        assert got.version == 1
        # Claimed by both, but TERMINAL (v2 only) carries the drained evidence.
        assert got.capabilities == V1_CAPS
        with pytest.raises(CapabilityMissingError) as info:
            require(got, Capability.INFLIGHT_CANCEL, Capability.CHUNKED_WRITE)
        assert info.value.missing == Capability.INFLIGHT_CANCEL
        assert info.value.negotiated == got
        assert "INFLIGHT_CANCEL" in str(info.value)
        require(got, Capability.CHUNKED_WRITE)  # present: no error


def test_no_common_version_names_each_offer() -> None:
    with pytest.raises(VersionMismatchError) as info:
        negotiate([v2([2]), v1(1), v2([1, 2])])
    assert info.value.offers == ((2,), (1,), (1, 2))
    assert "rank 0 offers [2]" in str(info.value)
    assert "rank 1 offers [1]" in str(info.value)
    assert isinstance(info.value, NegotiationError)
    # A version every rank offers but this build does not speak is no choice.
    with pytest.raises(VersionMismatchError):
        negotiate([v2([3, 4]), v1(3)])
    assert negotiate([v2([1, 2, 3]), v2([2, 3])]).version == 2


def test_abi_mismatch() -> None:
    with pytest.raises(AbiMismatchError) as info:
        negotiate([v2(abi="msgpack-v1"), v2(abi="json-v1")])
    assert info.value.abis == ("json-v1", "msgpack-v1")
    assert "disagree" in str(info.value)
    # A v1 descriptor implies msgpack-v1, so it clashes with any other ABI.
    with pytest.raises(AbiMismatchError):
        negotiate([v1(), v2(abi="json-v1")])
    # Agreement on an ABI this build cannot speak is still refused.
    with pytest.raises(AbiMismatchError, match="not one this build speaks"):
        negotiate([v2(abi="json-v1"), v2(abi="json-v1")])


def test_unknown_capability_bits_are_dropped() -> None:
    got = negotiate([v2(caps=2**32 - 1), v2(caps=2**32 - 1)])
    assert got.capabilities == ALL_CAPABILITIES
    assert int(got.capabilities) == ALL


def test_bad_input_is_a_negotiation_error() -> None:
    bad_topologies = {
        "empty": [],
        "not a descriptor": [local_descriptor(), "v2"],
        "a message": [decode_frame(encode_frame(local_descriptor())), 7],
        "empty version list": [v2([])],
        "version 0": [v2([0, 1])],
        "v1 version 0": [v1(0)],
        "bool version": [v2([True])],
        "negative caps": [v2(caps=-1)],
        "caps past u32": [v2(caps=2**32)],
        "empty abi": [v2(abi="")],
    }
    for name, topology in bad_topologies.items():
        with pytest.raises(NegotiationError):
            negotiate(topology)  # type: ignore[arg-type]
        assert name


def test_negotiated_is_frozen() -> None:
    got = negotiate([local_descriptor()])
    with pytest.raises(AttributeError):
        got.version = 1  # type: ignore[misc]


@settings(max_examples=50, deadline=None)
@given(_topologies)
def test_descriptors_negotiate_the_same_after_a_frame_hop(
    descriptors: list[RankDescriptorV1 | RankDescriptorV2],
) -> None:
    # Descriptors travel as frames before negotiation (version=None).
    hopped = [
        decode_frame(encode_frame(d, version=1 if isinstance(d, RankDescriptorV1) else 2))
        for d in descriptors
    ]
    assert hopped == descriptors
    assert _outcome(hopped) == _outcome(descriptors)  # type: ignore[arg-type]


def test_negotiated_encodes() -> None:
    # Actors log and ship the result; it must be plain data.
    got = negotiate([local_descriptor()])
    assert msgspec.json.decode(msgspec.json.encode(got), type=Negotiated).version == got.version
