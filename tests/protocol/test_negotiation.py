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
    ACTIVE_CANCEL_CAPABILITIES,
    ALL_CAPABILITIES,
    DEFAULT_DESCRIPTOR,
    LOCAL_ABI,
    REQUIRED_CAPABILITIES,
    SUPPORTED_VERSIONS,
    UNNEGOTIATED_VERSION,
    AbiMismatchError,
    Capability,
    CapabilityMissingError,
    Negotiated,
    NegotiationError,
    NotNegotiatedError,
    RankDescriptorV1,
    RankDescriptorV2,
    Reject,
    RejectReason,
    VersionMismatchError,
    active_cancel,
    agree,
    allowed_kinds,
    check_unnegotiated,
    decode_frame,
    descriptor_frame,
    encode_frame,
    frame_version,
    local_descriptor,
    negotiate,
    refusal_kind,
    reject_for,
    require,
    samples,
    summary,
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


# ---- at runtime: what the rank actors ask (`agree` and friends) ------------------------


def _agree(descriptors: list[RankDescriptorV1 | RankDescriptorV2]) -> Negotiated | type:
    try:
        return agree([descriptor_frame(d) for d in descriptors])
    except NegotiationError as exc:
        return type(exc)


@settings(max_examples=200, deadline=None)
@given(_topologies, st.data())
def test_agree_is_negotiate_plus_what_this_build_needs(
    descriptors: list[RankDescriptorV1 | RankDescriptorV2], data: st.DataObject
) -> None:
    """`agree` decides like `negotiate` over the decoded frames, order-free, and
    refuses (CapabilityMissingError) an answer without REQUIRED_CAPABILITIES."""
    expected = _model(descriptors)
    if isinstance(expected, Negotiated) and not expected.supports(REQUIRED_CAPABILITIES):
        expected = CapabilityMissingError
    assert _agree(descriptors) == expected
    assert _agree(data.draw(st.permutations(descriptors))) == expected


def test_agree_refuses_a_v1_topology_and_a_rank_without_terminal() -> None:
    # Every rank speaks v1: v1 cannot carry TERMINAL, which every edge needs.
    with pytest.raises(CapabilityMissingError) as info:
        agree([descriptor_frame(v1()), descriptor_frame(v2())])
    assert info.value.missing & Capability.TERMINAL_V1
    assert info.value.negotiated.version == 1
    # v2, but one rank lacks TERMINAL.
    with pytest.raises(CapabilityMissingError):
        agree([descriptor_frame(v2(caps=ALL & ~Capability.TERMINAL_V1)), descriptor_frame(v2())])
    # v2, but one rank's OPEN would not carry its buffer info.
    with pytest.raises(CapabilityMissingError):
        agree([descriptor_frame(v2(caps=ALL & ~Capability.OPEN_CARRIES_BUFFER_INFO)), descriptor_frame(v2())])


def test_agree_on_the_mixes_the_actor_tests_launch() -> None:
    only2 = descriptor_frame(v2([2]))
    # [1, 2] among [2]-only ranks: v2, everything, the active cancel protocol.
    got = agree([descriptor_frame(v2([1, 2])), only2, only2])
    assert got == Negotiated(version=2, capabilities=ALL_CAPABILITIES, abi=ABI_MSGPACK_V1)
    assert active_cancel(got)
    # A v1 rank among [2]-only ranks: no common version, each offer named.
    with pytest.raises(VersionMismatchError) as info:
        agree([only2, descriptor_frame(v1()), only2])
    assert info.value.offers == ((2,), (1,), (2,))
    # One rank without INFLIGHT_CANCEL: agreed, but conservative.
    got = agree([descriptor_frame(v2(caps=ALL & ~Capability.INFLIGHT_CANCEL)), only2])
    assert got.version == 2 and not active_cancel(got)
    # Without TERMINAL_V1 the active protocol cannot run either (it carries the evidence).
    assert ACTIVE_CANCEL_CAPABILITIES == Capability.INFLIGHT_CANCEL | Capability.TERMINAL_V1


def test_agree_waits_for_every_rank_and_refuses_bad_frames() -> None:
    frame = descriptor_frame(local_descriptor())
    with pytest.raises(NotNegotiatedError) as info:
        agree([frame, None, frame])
    assert (info.value.known, info.value.expected) == (2, 3)
    with pytest.raises(NotNegotiatedError):
        agree([])
    # A frame that does not decode, and a frame that is no descriptor: typed, indexed.
    with pytest.raises(NegotiationError, match="rank 1: descriptor does not decode"):
        agree([frame, b"KVHF\x02junk"])
    with pytest.raises(NegotiationError, match="rank 0: Reject is not a rank descriptor"):
        agree([encode_frame(samples()[5]), frame])
    # A locally built descriptor that breaks the schema is caught at the receive boundary.
    with pytest.raises(NegotiationError, match="does not decode"):
        agree([descriptor_frame(RankDescriptorV1(version=0, capabilities=ALL)), frame])
    with pytest.raises(NegotiationError):
        descriptor_frame(samples()[0])  # type: ignore[arg-type]


def test_descriptor_frames_are_written_in_the_oldest_version_that_carries_them() -> None:
    assert descriptor_frame(v1())[4] == 1  # a v1-only build reads it
    assert descriptor_frame(v2())[4] == 2
    assert decode_frame(descriptor_frame(v2([2], 7))) == v2([2], 7)


def test_frame_versions_with_and_without_an_agreement() -> None:
    open_msg, ready, cancel, terminal, receipt, reject, *_ = samples()
    agreed = agree([descriptor_frame(v2([2]))])
    for message in (open_msg, ready, cancel, terminal, receipt, reject):
        assert frame_version(agreed, message) == 2
        assert frame_version(agreed, message, answering=1) == 2  # the agreement wins
    refused = VersionMismatchError(((1,), (2,)))
    # Without one: only OPEN and REJECT are written, the REJECT in its OPEN's version.
    assert frame_version(refused, open_msg) == UNNEGOTIATED_VERSION == 1
    assert frame_version(refused, reject) == UNNEGOTIATED_VERSION
    assert frame_version(refused, reject, answering=2) == 2
    assert frame_version(refused, reject, answering=9) == UNNEGOTIATED_VERSION  # not one we speak
    for message in (ready, cancel, terminal, receipt):
        with pytest.raises(VersionMismatchError):
            frame_version(refused, message)
    # Both kinds exist in the version they are written in.
    assert {"open", "reject"} <= allowed_kinds(UNNEGOTIATED_VERSION)


def test_without_an_agreement_only_a_reject_is_read() -> None:
    open_msg, ready, cancel, terminal, receipt, reject, *_ = samples()
    pending = NotNegotiatedError(1, 2)
    check_unnegotiated(pending, reject)  # only ends a session that moved no byte
    for message in (open_msg, ready, cancel, terminal, receipt):
        with pytest.raises(NotNegotiatedError):
            check_unnegotiated(pending, message)
    # Raising the one stored error again and again does not grow its traceback.
    depths = []
    for _ in range(3):
        try:
            check_unnegotiated(pending, open_msg)
        except NotNegotiatedError as exc:
            tb, n = exc.__traceback__, 0
            while tb is not None:
                tb, n = tb.tb_next, n + 1
            depths.append(n)
    assert depths[0] == depths[1] == depths[2]


def test_a_negotiation_refusal_is_a_typed_reject() -> None:
    open_msg = samples()[0]
    error = VersionMismatchError(((1,), (2,)))
    reject = reject_for(open_msg, error, open_msg.ticket.ctx)
    assert isinstance(reject, Reject)
    assert reject.reason is RejectReason.NEGOTIATION
    assert reject.ticket == open_msg.ticket
    assert "no common protocol version" in reject.detail
    for other in (NotNegotiatedError(0, 2), CapabilityMissingError(Capability.TERMINAL_V1, agree([descriptor_frame(v2())]))):
        got = reject_for(open_msg, other, open_msg.ticket.ctx)
        assert got is not None and got.reason is RejectReason.NEGOTIATION


def test_refusal_kinds_and_summary() -> None:
    agreed = agree([descriptor_frame(local_descriptor())])
    assert summary(agreed) == {"version": 2, "capabilities": ALL, "abi": ABI_MSGPACK_V1, "active_cancel": True}
    cases = {
        "version": VersionMismatchError(((1,), (2,))),
        "abi": AbiMismatchError(("a", "b")),
        "capability": CapabilityMissingError(Capability.TERMINAL_V1, agreed),
        "pending": NotNegotiatedError(0, 3),
        "descriptor": NegotiationError("rank 0: invalid version list []"),
    }
    for kind, error in cases.items():
        assert refusal_kind(error) == kind
        assert summary(error) == {"error": kind, "detail": str(error)}
        assert not active_cancel(error)
    # Plain data: stats() crosses a Ray hop and the CLI prints it as JSON.
    assert msgspec.json.decode(msgspec.json.encode(summary(agreed))) == summary(agreed)
