"""Topology-wide protocol negotiation (docs/design.md "Negotiation").

Theory of operation
-------------------
Every rank advertises a descriptor: which control-protocol versions it speaks,
which capability bits it has, and its serialization ABI. `negotiate` turns the
descriptors of *all* ranks of a topology into one `Negotiated` answer. It is a
pure function of the *set* of descriptors, so every rank that collects the same
descriptors computes the same answer in any order (permutation invariance), and
no coordination beyond exchanging descriptors is needed:

- **version**: the highest version that every rank offers and this build
  speaks (`SUPPORTED_VERSIONS`);
- **capabilities**: the intersection (bitwise AND) of every rank's bits,
  restricted to the bits this build knows and to those the selected version
  can carry (table below);
- **ABI**: must be the same string on every rank, and one this build speaks.

Any disagreement raises a `NegotiationError` subclass that carries the data
explaining it, before any buffer is registered or any DMA posted. A dynamic
OPEN never changes the outcome: it is a proposal inside the negotiated
protocol, not a renegotiation.

Descriptors
-----------
| descriptor         | versions offered          | ABI                      |
| ------------------ | ------------------------- | ------------------------ |
| `RankDescriptorV1` | exactly its one `version` | `ABI_MSGPACK_V1` (fixed) |
| `RankDescriptorV2` | its `versions` list       | its `abi` field          |

`ABI_MSGPACK_V1` ("msgpack-v1") names the encoding of `_wire.py`: a 12-byte
big-endian header and a msgspec MessagePack body, structs as maps with a
``"kind"`` tag, `BlockDescriptor` as a 4-element array. v1 descriptors predate
the ABI field, so they are read as that ABI.

Capabilities per version
------------------------
Some capabilities need messages that only v2 frames carry (`_wire.py`'s kind
table), so a topology that settles on v1 cannot use them even if every rank
claims them:

| capability               | v1 | v2 | why                                          |
| ------------------------ | -- | -- | -------------------------------------------- |
| INFLIGHT_CANCEL          | –  | ✓  | drained/unknown evidence travels in TERMINAL |
| TERMINAL_V1              | –  | ✓  | TERMINAL is a v2 kind                        |
| OPEN_CARRIES_BUFFER_INFO | ✓  | ✓  | OPEN exists in v1                            |
| CHUNKED_WRITE            | ✓  | ✓  | data plane only                              |
| STAGED_WRITE             | ✓  | ✓  | data plane only                              |
| PACKED_BLOCKS            | –  | ✓  | v1 frames keep the one-descriptor-per-block  |
|                          |    |    | OPEN every older build reads                 |
| BLOCK_RUNS               | –  | ✓  | as PACKED_BLOCKS: a newer OPEN form          |

Use `require` before anything that depends on a capability: e.g. the active
cancellation protocol calls ``require(negotiated, Capability.INFLIGHT_CANCEL)``
and falls back to the conservative path on `CapabilityMissingError`.

At runtime (the rank actors)
----------------------------
The actors gather; this module decides (docs/design.md "Negotiation"):

- each rank publishes `descriptor_frame(its descriptor)` in the directory;
- each rank passes the frames of *every* rank of both instances (None for one
  not registered yet) to `agree`, which decodes them (`decode_frame` with
  ``version=None``: the receive boundary, so a malformed descriptor is a
  typed error), negotiates, and requires `REQUIRED_CAPABILITIES`: what this
  build's session machines cannot run without (TERMINAL evidence and
  RECEIPT are v2 kinds, so a v1 topology is refused, typed). A rank with
  no agreement yet gets `NotNegotiatedError`;
- `active_cancel` says whether the active cancellation protocol may run
  (`ACTIVE_CANCEL_CAPABILITIES`); otherwise the conservative path runs;
- with an agreement, every frame is written in and read against its version
  (`frame_version`). Without one, a rank refuses every frame
  (`check_unnegotiated`) except the two it needs to refuse a handoff with a
  typed reason: the GEN's OPEN (answered with REJECT(NEGOTIATION), see
  `reject_for`) and that REJECT (which only ends a session that moved no
  byte). Both exist in every version: the OPEN is written in
  `UNNEGOTIATED_VERSION`, which any build reads, and the REJECT in the
  version of the OPEN it answers, which its sender reads (even a sender
  that did agree, e.g. while a changed descriptor is seen by one side first);
- `refusal_kind` names a refusal for counters and `summary` gives the
  outcome for `stats()`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeGuard, Union

import msgspec

from ._errors import NegotiationError, ProtocolError
from ._messages import Capability, Message, Open, RankDescriptorV1, RankDescriptorV2, Reject
from ._wire import SUPPORTED_VERSIONS, allowed_kinds, decode_frame, encode_frame

__all__ = [
    "ABI_MSGPACK_V1",
    "LOCAL_ABI",
    "ALL_CAPABILITIES",
    "RankDescriptor",
    "Negotiated",
    "VersionMismatchError",
    "AbiMismatchError",
    "CapabilityMissingError",
    "negotiate",
    "require",
    "local_descriptor",
    "DEFAULT_DESCRIPTOR",
    "REQUIRED_CAPABILITIES",
    "ACTIVE_CANCEL_CAPABILITIES",
    "UNNEGOTIATED_VERSION",
    "NotNegotiatedError",
    "NegotiationOutcome",
    "descriptor_frame",
    "agree",
    "active_cancel",
    "frame_version",
    "check_unnegotiated",
    "refusal_kind",
    "summary",
]

#: The serialization ABI of `_wire.py` (see "Descriptors"); implied by every v1 descriptor.
ABI_MSGPACK_V1: Final = "msgpack-v1"
#: The ABI this build writes and reads.
LOCAL_ABI: Final = ABI_MSGPACK_V1
# ABIs this build can speak; negotiating anything else would be a promise we cannot keep.
_KNOWN_ABIS: Final = frozenset({ABI_MSGPACK_V1})

#: Every capability bit this build knows.
ALL_CAPABILITIES: Final = functools.reduce(operator.or_, Capability, Capability(0))

# The "Capabilities per version" table.
_VERSION_CAPABILITIES: Final[Mapping[int, Capability]] = MappingProxyType(
    {
        1: Capability.OPEN_CARRIES_BUFFER_INFO | Capability.CHUNKED_WRITE | Capability.STAGED_WRITE,
        2: ALL_CAPABILITIES,
    }
)
assert tuple(sorted(_VERSION_CAPABILITIES)) == SUPPORTED_VERSIONS

#: Either descriptor kind.
RankDescriptor = Union[RankDescriptorV1, RankDescriptorV2]


class Negotiated(msgspec.Struct, frozen=True, kw_only=True):
    """The protocol a whole topology agreed on (the result of `negotiate`)."""

    version: int  # highest version every rank speaks
    capabilities: Capability  # intersection, masked to what `version` can carry
    abi: str  # the serialization ABI every rank shares

    def supports(self, capability: Capability) -> bool:
        """True when every bit of `capability` was negotiated."""
        return (self.capabilities & capability) == capability


class VersionMismatchError(NegotiationError):
    """No protocol version is offered by every rank (and spoken by this build).

    `offers[i]` is the sorted tuple of versions descriptor `i` offered.
    """

    def __init__(self, offers: tuple[tuple[int, ...], ...]) -> None:
        listing = "; ".join(f"rank {i} offers {list(v)}" for i, v in enumerate(offers))
        super().__init__(
            f"no common protocol version (this build speaks {list(SUPPORTED_VERSIONS)}): {listing}"
        )
        self.offers = offers


class AbiMismatchError(NegotiationError):
    """The ranks disagree on the serialization ABI, or share one this build lacks.

    `abis` is the sorted tuple of distinct ABIs the ranks offered.
    """

    def __init__(self, abis: tuple[str, ...]) -> None:
        if len(abis) > 1:
            text = f"ranks disagree on the serialization ABI: {list(abis)}"
        else:
            text = f"serialization ABI {abis[0]!r} is not one this build speaks ({sorted(_KNOWN_ABIS)})"
        super().__init__(text)
        self.abis = abis


class CapabilityMissingError(NegotiationError):
    """A capability the caller needs was not negotiated topology-wide."""

    def __init__(self, missing: Capability, negotiated: Negotiated) -> None:
        super().__init__(
            f"capability {missing!r} was not negotiated "
            f"(protocol v{negotiated.version}, capabilities {negotiated.capabilities!r})"
        )
        self.missing = missing
        self.negotiated = negotiated


def _offer(index: int, descriptor: object) -> tuple[frozenset[int], int, str]:
    # What one descriptor offers: (versions, capability bits, ABI). Descriptors
    # that came through decode_frame are already bounded by the schema, but a
    # locally built Struct is not validated by msgspec, so check the few
    # things the selection relies on and name the rank that broke them.
    if isinstance(descriptor, RankDescriptorV1):
        versions: list[object] = [descriptor.version]
        capabilities: object = descriptor.capabilities
        abi: object = ABI_MSGPACK_V1
    elif isinstance(descriptor, RankDescriptorV2):
        versions = list(descriptor.versions) if isinstance(descriptor.versions, list) else []
        capabilities = descriptor.capabilities
        abi = descriptor.abi
    else:
        raise NegotiationError(
            f"rank {index}: {type(descriptor).__name__} is not a rank descriptor"
        )
    if not versions or any(not _is_int(v) or not 1 <= v <= 255 for v in versions):
        raise NegotiationError(f"rank {index}: invalid version list {versions!r}")
    if not _is_int(capabilities) or not 0 <= capabilities < 2**32:
        raise NegotiationError(f"rank {index}: invalid capability bits {capabilities!r}")
    if not isinstance(abi, str) or not abi:
        raise NegotiationError(f"rank {index}: invalid ABI {abi!r}")
    return frozenset(int(v) for v in versions if _is_int(v)), int(capabilities), abi


def _is_int(value: object) -> TypeGuard[int]:
    # Any int (a Capability flag is one) except bool, which is never a version
    # or a bit set.
    return isinstance(value, int) and not isinstance(value, bool)


def negotiate(descriptors: Sequence[RankDescriptor]) -> Negotiated:
    """Select the protocol for a topology from the descriptors of all its ranks.

    Deterministic and order-independent (see the module docstring). Raises
    `NegotiationError` for an empty sequence or a malformed descriptor,
    `AbiMismatchError` when the ABIs differ or are unknown to this build, and
    `VersionMismatchError` (naming each rank's offer) when no version is
    common to every rank and this build.
    """
    offers = [_offer(i, d) for i, d in enumerate(descriptors)]
    if not offers:
        raise NegotiationError("no rank descriptors: a topology has at least one rank")

    abis = tuple(sorted({abi for _, _, abi in offers}))
    if len(abis) != 1 or abis[0] not in _KNOWN_ABIS:
        raise AbiMismatchError(abis)

    common = frozenset(SUPPORTED_VERSIONS).intersection(*(versions for versions, _, _ in offers))
    if not common:
        raise VersionMismatchError(tuple(tuple(sorted(versions)) for versions, _, _ in offers))
    version = max(common)

    # AND over every rank, then keep only bits this build knows (a newer peer
    # may set bits we cannot interpret) and that the selected version carries.
    bits = functools.reduce(operator.and_, (caps for _, caps, _ in offers))
    capabilities = Capability(bits & _VERSION_CAPABILITIES[version])
    return Negotiated(version=version, capabilities=capabilities, abi=abis[0])


def require(negotiated: Negotiated, *capabilities: Capability) -> None:
    """Raise `CapabilityMissingError` unless every given capability was negotiated.

    Call it before the work that needs the capability, e.g. before posting
    any DMA under the active cancellation protocol::

        require(negotiated, Capability.INFLIGHT_CANCEL)
    """
    needed = functools.reduce(operator.or_, capabilities, Capability(0))
    missing = Capability(needed & ~negotiated.capabilities)
    if missing:
        raise CapabilityMissingError(missing, negotiated)


def local_descriptor() -> RankDescriptorV2:
    """A fresh descriptor for this build: v2 listing every supported version,
    every known capability, and `LOCAL_ABI`."""
    return RankDescriptorV2(
        versions=list(SUPPORTED_VERSIONS), capabilities=int(ALL_CAPABILITIES), abi=LOCAL_ABI
    )


#: This build's descriptor (equal to `local_descriptor()`). Its `versions` is a
#: list, which a frozen Struct cannot protect: never mutate it; call
#: `local_descriptor()` for a copy you may change.
DEFAULT_DESCRIPTOR: Final = local_descriptor()


# --- at runtime: what the rank actors ask ---------------------------------------------

#: What this build's rank session machines cannot run without: TERMINAL evidence
#: ends every edge (and RECEIPT answers it; both are v2 kinds), and an OPEN
#: carries the complete buffer info the CTX checks and writes into. A topology
#: that did not negotiate these moves no byte.
REQUIRED_CAPABILITIES: Final = Capability.TERMINAL_V1 | Capability.OPEN_CARRIES_BUFFER_INFO
#: What the active cancellation protocol (cancel with DMA in flight: drain,
#: then DRAINED/UNKNOWN evidence in TERMINAL) needs; without every bit the
#: CTX ranks run the conservative path (a cancel waits for a decided transfer).
ACTIVE_CANCEL_CAPABILITIES: Final = Capability.INFLIGHT_CANCEL | Capability.TERMINAL_V1
#: The version of the frames that cross without an agreement (OPEN and the
#: REJECT that refuses it): the oldest this build speaks, which any build reads.
UNNEGOTIATED_VERSION: Final = min(SUPPORTED_VERSIONS)
# The kinds that may cross without an agreement (see the module docstring).
_UNNEGOTIATED_KINDS: Final = (Open, Reject)
assert all(
    str(k.__struct_config__.tag) in allowed_kinds(UNNEGOTIATED_VERSION)
    for k in _UNNEGOTIATED_KINDS
)


class NotNegotiatedError(NegotiationError):
    """No protocol agreed yet: only `known` of the `expected` rank descriptors
    are known (a rank is still starting), so nothing that needs one may run."""

    def __init__(self, known: int, expected: int) -> None:
        super().__init__(
            f"no protocol agreed yet: {known} of {expected} rank descriptors known"
        )
        self.known = known
        self.expected = expected


#: What a rank holds about its topology's protocol: the agreement, or why there is none.
NegotiationOutcome = Union[Negotiated, NegotiationError]


def descriptor_frame(descriptor: RankDescriptor) -> bytes:
    """`descriptor` as the frame a rank publishes: in the oldest version that
    carries its kind (a v1 descriptor in a v1 frame, so a v1-only build reads it).

    Raises `NegotiationError` for anything that is not a descriptor, and
    `FrameError` for one that cannot be encoded.
    """
    if not isinstance(descriptor, (RankDescriptorV1, RankDescriptorV2)):
        raise NegotiationError(f"{type(descriptor).__name__} is not a rank descriptor")
    tag = str(type(descriptor).__struct_config__.tag)
    version = min(v for v in SUPPORTED_VERSIONS if tag in allowed_kinds(v))
    return encode_frame(descriptor, version=version)


def agree(frames: Sequence[bytes | None]) -> Negotiated:
    """The protocol of a pair of instances, from the descriptor frame of every
    rank of both (None: that rank's descriptor is not known yet).

    A pure function of the *set* of frames, like `negotiate`: every rank that
    holds the same frames agrees on the same answer. Raises
    `NotNegotiatedError` while a frame is missing, `NegotiationError` for a
    frame that does not decode to a descriptor (naming its index), the errors
    of `negotiate`, and `CapabilityMissingError` when `REQUIRED_CAPABILITIES`
    were not all negotiated (a v1 topology, or a rank without TERMINAL).
    """
    known = [f for f in frames if f is not None]
    if len(known) != len(frames) or not frames:
        raise NotNegotiatedError(len(known), len(frames))
    descriptors: list[RankDescriptor] = []
    for index, frame in enumerate(known):
        try:
            message = decode_frame(frame)
        except ProtocolError as exc:
            raise NegotiationError(f"rank {index}: descriptor does not decode: {exc}") from exc
        if not isinstance(message, (RankDescriptorV1, RankDescriptorV2)):
            raise NegotiationError(f"rank {index}: {type(message).__name__} is not a rank descriptor")
        descriptors.append(message)
    negotiated = negotiate(descriptors)
    require(negotiated, REQUIRED_CAPABILITIES)
    return negotiated


def active_cancel(outcome: NegotiationOutcome) -> bool:
    """Whether the active cancellation protocol may run: an agreement that
    carries every bit of `ACTIVE_CANCEL_CAPABILITIES`. Otherwise: conservative."""
    return isinstance(outcome, Negotiated) and outcome.supports(ACTIVE_CANCEL_CAPABILITIES)


def frame_version(
    outcome: NegotiationOutcome, message: Message, *, answering: int | None = None
) -> int:
    """The version to write `message` in: the agreed one; without an
    agreement, a REJECT answering a frame of version `answering` is written in
    that version (its sender reads it, also one that did agree: a peer may
    learn of a changed descriptor first), any other OPEN or REJECT in
    `UNNEGOTIATED_VERSION`. Any other message has no version to be written in
    without an agreement: raises the outcome's error."""
    if isinstance(outcome, Negotiated):
        return outcome.version
    if isinstance(message, Reject) and answering in SUPPORTED_VERSIONS:
        assert answering is not None
        return answering
    if isinstance(message, _UNNEGOTIATED_KINDS):
        return UNNEGOTIATED_VERSION
    # A rank raises its one stored error for every refusal: drop the previous
    # raise's traceback so it does not grow with each one.
    raise outcome.with_traceback(None)


def check_unnegotiated(outcome: NegotiationError, message: Message) -> None:
    """A rank without an agreement read `message` (decoded with ``version=None``).

    A REJECT passes: it only ends a session that moved no byte. Anything else
    is refused with the outcome's error; for an OPEN addressed to the rank,
    `reject_for` turns that error into REJECT(NEGOTIATION), before any DMA.
    """
    if not isinstance(message, Reject):
        raise outcome.with_traceback(None)  # see frame_version


def refusal_kind(error: NegotiationError) -> str:
    """A short name for a refusal (stats counters ``refused_negotiation_<kind>``):
    version, abi, capability, pending (no agreement yet) or descriptor."""
    if isinstance(error, VersionMismatchError):
        return "version"
    if isinstance(error, AbiMismatchError):
        return "abi"
    if isinstance(error, CapabilityMissingError):
        return "capability"
    if isinstance(error, NotNegotiatedError):
        return "pending"
    return "descriptor"


def summary(outcome: NegotiationOutcome) -> dict[str, object]:
    """`outcome` as plain data for `stats()`: the agreement (version, capability
    bits, ABI, whether the active cancel protocol runs), or the refusal."""
    if isinstance(outcome, Negotiated):
        return {
            "version": outcome.version,
            "capabilities": int(outcome.capabilities),
            "abi": outcome.abi,
            "active_cancel": active_cancel(outcome),
        }
    return {"error": refusal_kind(outcome), "detail": str(outcome)}
