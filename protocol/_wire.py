"""Frames: the bytes that carry one control-plane message (docs/design.md "Messages").

Theory of operation
-------------------
A frame is a fixed 12-byte header followed by a msgspec MessagePack body::

    offset  size  field      meaning
    0       4     magic      b"KVHF" (kvhandoff frame)
    4       1     version    control-protocol version the frame is written in
    5       1     kind       message kind code (table below)
    6       2     reserved   must be 0 (room for flags in a later version)
    8       4     body_len   number of body bytes that follow, exactly

All integers are network byte order (`struct` format ``!4sBBHI``).

`decode_frame` is the one receive boundary. It refuses a frame in two stages,
and never lets anything but a `ProtocolError` subclass escape:

1. **Structure** (`FrameError`), checked on the raw bytes before a single byte
   of the body is parsed: the input is a byte buffer, its total length is at
   most the cap (`MAX_FRAME_LEN` by default) and at least a header, the magic
   matches, the version is one this build speaks (and the negotiated one when
   the caller passes it), the reserved bits are zero, the kind code is known
   *and allowed in that version*, and ``body_len`` equals the rest of the
   buffer exactly. Because the length is compared with the bytes actually
   present, a header that declares 4 GiB allocates nothing.
2. **Map shape** (`DecodeError`): msgspec, like most MessagePack decoders,
   lets a repeated map key overwrite the earlier value *after decoding both*,
   and scans a whole map for the tag when the tag is not its first key. A
   body that repeats ``"buffer"`` or ``"blocks"`` could thus make the typed
   decoder build 16384 block descriptors again and again within one frame
   (measured: 17 ms for a 1 MiB frame instead of ~2 ms). So before anything
   is built, each map the schema has (message → ticket → endpoint →
   namespace, and message → buffer) is split into its keys and raw,
   undecoded values by a zero-copy msgspec pass, and refused when its header
   counts more entries than it has distinct keys. The message map must also
   start with its ``"kind"`` tag, as `encode_frame` always writes it. Each
   pass re-skips the bytes below it, so to keep the total at two passes over
   the body, a map below depth 2 (an endpoint or a namespace, a few hundred
   bytes when legal) larger than `_MAX_INNER_MAP_LEN` is refused unread.
3. **Typed decode** (`DecodeError`): one module-level msgspec `Decoder` over the
   `Message` union (tag field ``"kind"``) types the body. The schema forbids
   unknown fields and bounds every string and list, so decode work and the
   state a peer can make us retain are bounded by the frame cap. The schema
   bounds nesting depth as well: a typed decode stops at the first value of
   the wrong type, and a nesting bomb hidden where msgspec must skip a value
   (in stage 2, or under an unknown key) hits msgspec's recursion guard,
   whose `RecursionError` is reported as a `DecodeError` like any other
   malformed body. Finally the body's tag must be the kind the header
   announced: a READY body under an OPEN header is refused.

Together the stages bound the work per frame: at most two skipping passes
over the body plus one typed decode in which no field is decoded twice and
no list is longer than its bound. The worst frames we know of, legal or
hostile, decode in about 3 ms (tests/protocol/test_fuzz.py measures them).

`decode_frame` is pure: it reads its input, builds a new message that shares
no memory with the input buffer, and touches no module state, so a rejected
frame changes nothing anywhere.

`encode_frame` is its inverse. It refuses (with `FrameError`) a message whose
kind the requested version does not allow, and a body over the cap. It does
not re-validate field bounds: msgspec Structs are not validated when they are
constructed, so a locally built message that breaks a bound is caught by the
receiver's `decode_frame`. Encoding is deterministic: the same message always
gives the same bytes (fields are written in declaration order, defaults
included).

Kinds and versions
------------------
Kind codes are append-only: a code is never reused or renumbered.

| code | kind            | message            | v1 | v2 |
| ---- | --------------- | ------------------ | -- | -- |
| 1    | open            | `Open`             | ✓  | ✓  |
| 2    | ready           | `Ready`            | ✓  | ✓  |
| 3    | cancel          | `Cancel`           | ✓  | ✓  |
| 4    | terminal        | `Terminal`         | –  | ✓  |
| 5    | receipt         | `Receipt`          | –  | ✓  |
| 6    | reject          | `Reject`           | ✓  | ✓  |
| 7    | descriptor_v1   | `RankDescriptorV1` | ✓  | ✓  |
| 8    | descriptor_v2   | `RankDescriptorV2` | –  | ✓  |

v1 is the conservative protocol: no terminal evidence and no byte receipts, so
a v1 topology cannot cancel with DMA in flight (see `_negotiation.py`, which
masks the capabilities that need v2 messages). Descriptors are exchanged
*before* a version is negotiated, so callers decode them with ``version=None``
(any supported version); a build that must advertise itself to a v1-only peer
sends a `RankDescriptorV1` in a v1 frame.

Frame length cap
----------------
The largest legal message is an `Open` carrying `MAX_BLOCKS_PER_OPEN` (16384)
block descriptors. A `BlockDescriptor` is a 4-element array: 1 byte of array
header plus at most 5 + 9 + 9 + 5 bytes for its four integers, 29 bytes, so
the blocks take at most 16384 × 29 = 475,136 bytes; the ticket, the agent name
(128 characters, up to 512 bytes of UTF-8) and the keys add under 3 KiB. The
worst case is therefore about 465 KiB (476,404 bytes measured), and
`MAX_FRAME_LEN` is 512 KiB (10% headroom). The cap is deliberately not
larger: the worst-case decode time of a frame grows with its length (about
3 ms per MiB of minimal block descriptors merely to *skip*, 14 ms per MiB to
build them), and 512 KiB keeps every frame, legal or hostile, under ~5 ms.
The packed form of the same list (`Capability.PACKED_BLOCKS`, 24 bytes per
block in one byte string) is smaller: 16384 x 24 = 393,216 bytes plus a
5-byte bin header, and it decodes as one copy (about 0.1 ms for 8,192 blocks
against 1.7 ms for the descriptor list on the 2-core box). The run form
(`Capability.BLOCK_RUNS`, 24 bytes a run, at most 16,384 runs) is never
longer, and its counts are checked before any run is expanded.
A schema change that grows `BlockDescriptor` must revisit this number;
tests/protocol/test_wire.py checks the worst-case OPEN still fits, and
test_fuzz.py measures hostile frames.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import msgspec

from ._errors import DecodeError, FrameError
from ._messages import (
    BlockDescriptor,
    BufferInfo,
    Cancel,
    CancelReason,
    MemoryKind,
    Message,
    Open,
    RankDescriptorV1,
    RankDescriptorV2,
    Ready,
    Receipt,
    Reject,
    RejectReason,
    Terminal,
    TerminalKind,
)
from ._ticket import ContextTicket, Endpoint, RankNamespace, Role

__all__ = [
    "FRAME_MAGIC",
    "FRAME_HEADER_LEN",
    "MAX_FRAME_LEN",
    "CURRENT_VERSION",
    "SUPPORTED_VERSIONS",
    "encode_frame",
    "decode_frame",
    "kind_code",
    "allowed_kinds",
    "samples",
]

#: First four bytes of every frame.
FRAME_MAGIC: Final = b"KVHF"
# magic, version (u8), kind (u8), reserved (u16, zero), body length (u32).
_HEADER: Final = struct.Struct("!4sBBHI")
#: Size of the fixed header in bytes.
FRAME_HEADER_LEN: Final = _HEADER.size
#: Default cap on a whole frame (header + body), in bytes. See "Frame length cap".
MAX_FRAME_LEN: Final = 512 * 1024

#: The version `encode_frame` writes unless told otherwise.
CURRENT_VERSION: Final = 2
#: Every version this build can read and write, oldest first.
SUPPORTED_VERSIONS: Final = (1, 2)

# The kind table of the module docstring: message type -> (code, tag). Codes
# are append-only; the tag is the body's "kind" field and must agree.
_KIND_CODES: Final[Mapping[type, int]] = MappingProxyType(
    {
        Open: 1,
        Ready: 2,
        Cancel: 3,
        Terminal: 4,
        Receipt: 5,
        Reject: 6,
        RankDescriptorV1: 7,
        RankDescriptorV2: 8,
    }
)
_KIND_BY_CODE: Final[Mapping[int, type]] = MappingProxyType(
    {code: msg_type for msg_type, code in _KIND_CODES.items()}
)
# Which kinds each version allows. v1 has no terminal evidence, no receipts and
# no v2 descriptors; v2 allows everything.
_VERSION_KINDS: Final[Mapping[int, frozenset[type]]] = MappingProxyType(
    {
        1: frozenset({Open, Ready, Cancel, Reject, RankDescriptorV1}),
        2: frozenset(_KIND_CODES),
    }
)
assert tuple(sorted(_VERSION_KINDS)) == SUPPORTED_VERSIONS

# The one typed decoder and encoder. Both are stateless between
# calls, which is what makes decode_frame pure.
_DECODER: Final = msgspec.msgpack.Decoder(Message)
_ENCODER: Final = msgspec.msgpack.Encoder()
# Splits one map into its keys and raw (undecoded, zero-copy) values; used only
# to check map shape before the typed decode (stage 2 of the docstring).
_RAW_MAP_DECODER: Final = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
# Maps nest at most this deep in the schema: message → ticket → endpoint →
# namespace (and message → buffer). A map deeper than that is a type error the
# typed decoder reports on its first byte, so it needs no key check.
_MAX_MAP_DEPTH: Final = 4
# Maps below depth 2 are endpoints and namespaces: two bounded ids, an enum and
# a few ints, under 400 bytes at their largest. Anything bigger is refused
# before it is split, which caps the map-shape stage at two passes over the
# body (depth 1, then depth 2) however a hostile body nests.
_MAX_INNER_MAP_LEN: Final = 4096
# The tag field of every Message (msgspec writes it first).
_TAG_FIELD: Final = "kind"

# Whatever a malformed body can make msgspec raise. msgspec.MsgspecError covers
# DecodeError/ValidationError; RecursionError comes from msgspec's recursion
# guard when it skips a deeply nested unknown value; the rest are defence in
# depth (msgspec documents none of them for decode, but a receive boundary
# must not leak them if a future version does).
_BODY_ERRORS: Final = (
    msgspec.MsgspecError,
    RecursionError,
    MemoryError,
    OverflowError,
    ValueError,
    TypeError,
)


def _tag(msg_type: type) -> str:
    # msgspec keeps the tag in the struct config; every Message member has one.
    return str(msg_type.__struct_config__.tag)  # type: ignore[attr-defined]


def _map_len(raw: memoryview) -> int | None:
    # Entry count from a MessagePack map header, or None if `raw` is no map.
    first = raw[0]
    if 0x80 <= first <= 0x8F:  # fixmap
        return first & 0x0F
    if first == 0xDE and len(raw) >= 3:  # map 16
        return int.from_bytes(raw[1:3], "big")
    if first == 0xDF and len(raw) >= 5:  # map 32
        return int.from_bytes(raw[1:5], "big")
    return None  # not a map (or a truncated header the typed decoder reports)


def _check_map_shape(raw: memoryview, depth: int = 1) -> None:
    # Stage 2 of the module docstring. Raises DecodeError for a bad shape and
    # msgspec errors for malformed input (decode_frame wraps those). A value
    # that is not a map is left to the typed decoder.
    count = _map_len(raw)
    if count is None:
        return
    if depth > 2 and len(raw) > _MAX_INNER_MAP_LEN:
        raise DecodeError(
            f"a map at depth {depth} is {len(raw)} bytes; at most {_MAX_INNER_MAP_LEN} are legal there"
        )
    fields = _RAW_MAP_DECODER.decode(raw)
    if len(fields) != count:
        raise DecodeError(
            f"a map at depth {depth} repeats a key ({count} entries, {len(fields)} distinct)"
        )
    if depth == 1 and next(iter(fields), None) != _TAG_FIELD:
        raise DecodeError(f"the message map must start with its {_TAG_FIELD!r} tag")
    if depth < _MAX_MAP_DEPTH:
        for value in fields.values():
            _check_map_shape(memoryview(value), depth + 1)


def kind_code(msg_type: type) -> int:
    """The header kind code of a message type (`Open` → 1, …; see the table).

    Raises `FrameError` for a type that is not a `Message` member.
    """
    try:
        return _KIND_CODES[msg_type]
    except (KeyError, TypeError):
        raise FrameError(f"{msg_type!r} is not a message kind") from None


def allowed_kinds(version: int) -> frozenset[str]:
    """The kind tags (``"open"``, ``"terminal"``, …) that `version` allows.

    Raises `FrameError` for a version this build does not speak.
    """
    _check_version(version)
    return frozenset(_tag(t) for t in _VERSION_KINDS[version])


def _check_version(version: object) -> int:
    # bool is an int subclass; True must not pass for version 1.
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise FrameError(
            f"unsupported protocol version {version!r}; this build speaks {SUPPORTED_VERSIONS}"
        )
    return version


def encode_frame(msg: Message, *, version: int = CURRENT_VERSION) -> bytes:
    """Encode `msg` as one frame written in protocol `version`.

    Raises `FrameError` when `msg` is not a message, when `version` is not
    supported, when its kind is not allowed in `version` (e.g. a `Terminal`
    in v1), or when the body would exceed `MAX_FRAME_LEN`. Deterministic:
    equal messages give equal bytes.
    """
    _check_version(version)
    msg_type = type(msg)
    code = kind_code(msg_type)
    if msg_type not in _VERSION_KINDS[version]:
        raise FrameError(f"kind {_tag(msg_type)!r} is not allowed in protocol v{version}")
    try:
        body = _ENCODER.encode(msg)
    except (msgspec.MsgspecError, OverflowError, ValueError, TypeError) as exc:
        # Only a locally built message with an unencodable value gets here
        # (an int past 64 bits, a lone surrogate in a str).
        raise FrameError(f"cannot encode {_tag(msg_type)!r}: {exc}") from exc
    if FRAME_HEADER_LEN + len(body) > MAX_FRAME_LEN:
        raise FrameError(
            f"{_tag(msg_type)!r} frame of {FRAME_HEADER_LEN + len(body)} bytes exceeds the cap of {MAX_FRAME_LEN}"
        )
    return _HEADER.pack(FRAME_MAGIC, version, code, 0, len(body)) + body


def _byte_view(data: object) -> memoryview:
    # Accept exactly the byte buffers a carrier hands us; anything else (str,
    # int, a list of ints...) is a caller bug reported as a frame error.
    if isinstance(data, (bytes, bytearray)):
        return memoryview(data)
    if isinstance(data, memoryview):
        try:
            # A flat byte view of the same memory. A strided view cannot be
            # parsed in place; touching a released view raises ValueError.
            if not data.c_contiguous:
                raise FrameError("frame buffer is not a contiguous byte view")
            return data if data.format == "B" and data.ndim == 1 else data.cast("B")
        except (TypeError, ValueError) as exc:
            raise FrameError(f"frame buffer is not a usable byte view: {exc}") from None
    raise FrameError(f"a frame is bytes, bytearray or memoryview, not {type(data).__name__}")


def decode_frame(
    data: bytes | bytearray | memoryview,
    *,
    version: int | None = None,
    max_len: int = MAX_FRAME_LEN,
) -> Message:
    """Decode one frame into the message it carries.

    `version` is the negotiated protocol version; when given, a frame written
    in any other version is refused. Leave it `None` only before negotiation
    (descriptor exchange). `max_len` caps the whole frame in bytes.

    Raises `FrameError` when a structural check fails (checked before the body
    is parsed) and `DecodeError` when the body does not decode to the typed
    message the header announced. Nothing else escapes for any input, and no
    state anywhere changes. The returned message does not share memory with
    `data`, so the caller may reuse its buffer.
    """
    if version is not None:
        _check_version(version)
    view = _byte_view(data)
    try:
        size = view.nbytes
    except ValueError:  # a memoryview released under us
        raise FrameError("frame buffer was released") from None
    if size > max_len:
        raise FrameError(f"frame of {size} bytes exceeds the cap of {max_len}")
    if size < FRAME_HEADER_LEN:
        raise FrameError(
            f"frame of {size} bytes is shorter than the {FRAME_HEADER_LEN}-byte header"
        )
    magic, frame_version, code, reserved, body_len = _HEADER.unpack_from(view)
    if magic != FRAME_MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}, expected {FRAME_MAGIC!r}")
    if frame_version not in SUPPORTED_VERSIONS:
        raise FrameError(
            f"unsupported protocol version {frame_version}; this build speaks {SUPPORTED_VERSIONS}"
        )
    if version is not None and frame_version != version:
        raise FrameError(f"frame is protocol v{frame_version} but v{version} was negotiated")
    if reserved != 0:
        raise FrameError(f"reserved header bits set: {reserved:#06x}")
    expected_type = _KIND_BY_CODE.get(code)
    if expected_type is None:
        raise FrameError(f"unknown message kind code {code}")
    if expected_type not in _VERSION_KINDS[frame_version]:
        raise FrameError(
            f"kind {_tag(expected_type)!r} is not allowed in protocol v{frame_version}"
        )
    if body_len != size - FRAME_HEADER_LEN:
        raise FrameError(
            f"header declares a {body_len}-byte body but {size - FRAME_HEADER_LEN} bytes follow"
        )
    kind = _tag(expected_type)
    body = view[FRAME_HEADER_LEN:]
    try:
        if len(body):
            _check_map_shape(body)
        msg = _DECODER.decode(body)
    except _BODY_ERRORS as exc:  # our own DecodeError (map shape) passes through
        raise DecodeError(f"{kind!r} body does not decode: {type(exc).__name__}: {exc}") from exc
    if type(msg) is not expected_type:
        raise DecodeError(f"header announces {kind!r} but the body is {_tag(type(msg))!r}")
    return msg


# --- fuzz seeds -----------------------------------------------------------------

_SAMPLE_DIGEST_CTX: Final = bytes(range(32))
_SAMPLE_DIGEST_GEN: Final = bytes(range(32, 64))


def _sample_ticket() -> ContextTicket:
    return ContextTicket(
        request_id="req-0001",
        ctx_attempt=1,
        gen_attempt=2,
        ctx=Endpoint(ns=RankNamespace(instance_id="ctx-a", role=Role.CTX, rank=0), epoch=7),
        gen=Endpoint(ns=RankNamespace(instance_id="gen-b", role=Role.GEN, rank=1), epoch=9),
        ctx_digest=_SAMPLE_DIGEST_CTX,
        gen_digest=_SAMPLE_DIGEST_GEN,
    )


def samples() -> list[Message]:
    """One valid instance of every message kind, in kind-code order.

    Deterministic (fresh, equal objects on every call): the seeds of the fuzz
    tests and a quick way to get a well-formed message of each kind.
    """
    ticket = _sample_ticket()
    return [
        Open(
            ticket=ticket,
            buffer=BufferInfo(
                agent_name="gen-b/1@9",
                endpoint_epoch=9,
                memory=MemoryKind.DRAM,
                device=0,
                blocks=[
                    BlockDescriptor(block=b, generation=3 + b, addr=0x10000 + b * 4096, length=4096)
                    for b in range(4)
                ],
            ),
            num_tokens=64,
        ),
        Ready(ticket=ticket, round_no=5),
        Cancel(ticket=ticket, reason=CancelReason.CLIENT, detail="user abort"),
        Terminal(ticket=ticket, evidence=TerminalKind.COMPLETED, bytes_done=16384),
        Receipt(ticket=ticket, bytes_received=16384),
        Reject(ticket=ticket, reason=RejectReason.STALE, detail="older gen attempt"),
        RankDescriptorV1(version=1, capabilities=0),
        RankDescriptorV2(versions=[1, 2], capabilities=0b11111, abi="msgpack-v1"),
    ]
