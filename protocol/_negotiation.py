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

Use `require` before anything that depends on a capability: e.g. the active
cancellation protocol calls ``require(negotiated, Capability.INFLIGHT_CANCEL)``
and falls back to the conservative path on `CapabilityMissingError`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final, TypeGuard, Union

import msgspec

from ._errors import NegotiationError
from ._messages import Capability, RankDescriptorV1, RankDescriptorV2
from ._wire import SUPPORTED_VERSIONS

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
