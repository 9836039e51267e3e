"""Canonical topology digests (docs/design.md "Identity", "Vocabulary": topology).

Every `ContextTicket` carries the canonical digests of both sides' topologies,
so the digest must be a function of the spec's *value* alone, identical in
every process, on every machine and under every Python version. Python's
`hash()` is none of that (it is salted per process for strings).

The canonical encoding is:

    DOMAIN  ||  msgpack(spec, order="sorted")

where `DOMAIN` is a fixed prefix naming this encoding's version and msgspec's
`order="sorted"` writes the struct as a map with its keys sorted by field name,
so reordering fields in the class does not change the bytes. Values are
already canonical because `TopologySpec` normalizes them on construction
(tuple devices, float timeout, no -0.0, enums). msgpack floats are IEEE-754
doubles written bit-exactly, ints use their shortest encoding, strings are
UTF-8: nothing here depends on the platform.

The digest is SHA-256 of that encoding: 32 bytes (`protocol.DIGEST_LEN`).
Changing the encoding changes every digest; tests pin a golden value so that
can only happen on purpose (then bump `DOMAIN`).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvhandoff.protocol import DIGEST_LEN, TopologyError

from ._spec import TopologySpec

__all__ = [
    "TOPOLOGY_DIGEST_DOMAIN",
    "encode_topology",
    "decode_topology",
    "topology_digest",
    "digest_hex",
    "MAX_TOPOLOGY_ENCODING_LEN",
]

#: Prefix of the canonical encoding; bump the version to change the encoding.
TOPOLOGY_DIGEST_DOMAIN = b"kvhandoff/topology/v1\x00"
#: Longest canonical encoding `decode_topology` accepts (4096 devices fit easily).
MAX_TOPOLOGY_ENCODING_LEN = 64 * 1024

_decoder = msgspec.msgpack.Decoder(TopologySpec)


def encode_topology(spec: TopologySpec) -> bytes:
    """The canonical encoding of `spec` (what `topology_digest` hashes)."""
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")
    return TOPOLOGY_DIGEST_DOMAIN + msgspec.msgpack.encode(spec, order="sorted")


def decode_topology(data: bytes) -> TopologySpec:
    """Inverse of `encode_topology`; raises `TopologyError` on any bad input.

    `decode_topology(encode_topology(s)) == s` for every spec `s`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TopologyError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_TOPOLOGY_ENCODING_LEN:
        raise TopologyError(
            f"topology encoding is {len(data)} bytes, at most {MAX_TOPOLOGY_ENCODING_LEN}"
        )
    if not data.startswith(TOPOLOGY_DIGEST_DOMAIN):
        raise TopologyError("topology encoding does not start with the v1 domain prefix")
    try:
        return _decoder.decode(data[len(TOPOLOGY_DIGEST_DOMAIN) :])
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise TopologyError(f"bad topology encoding: {exc}") from None


def topology_digest(spec: TopologySpec) -> bytes:
    """SHA-256 of the canonical encoding of `spec`: 32 bytes, stable everywhere."""
    digest = hashlib.sha256(encode_topology(spec)).digest()
    assert len(digest) == DIGEST_LEN
    return digest


def digest_hex(spec_or_digest: TopologySpec | bytes) -> str:
    """Hex form of a digest, for logs: accepts a spec or a 32-byte digest."""
    if isinstance(spec_or_digest, TopologySpec):
        return topology_digest(spec_or_digest).hex()
    if isinstance(spec_or_digest, bytes) and len(spec_or_digest) == DIGEST_LEN:
        return spec_or_digest.hex()
    raise TopologyError(f"expected a TopologySpec or a {DIGEST_LEN}-byte digest")
