"""Frames round-trip every message kind, obey the version/kind table, and fit the cap."""

from __future__ import annotations

import array

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    CURRENT_VERSION,
    FRAME_HEADER_LEN,
    FRAME_MAGIC,
    MAX_BLOCKS_PER_OPEN,
    MAX_FRAME_LEN,
    PACKED_BLOCK_BYTES,
    RUN_BYTES,
    SUPPORTED_VERSIONS,
    BlockDescriptor,
    BlockRuns,
    BufferInfo,
    ContextTicket,
    DecodeError,
    FrameError,
    MemoryKind,
    Message,
    Open,
    ProtocolError,
    RankDescriptorV1,
    RankDescriptorV2,
    Receipt,
    Terminal,
    allowed_kinds,
    block_columns,
    decode_frame,
    encode_frame,
    kind_code,
    pack_blocks,
    pack_runs,
    samples,
)
from tests.protocol import strategies as s

ALL_KINDS = {
    "open",
    "ready",
    "cancel",
    "terminal",
    "receipt",
    "reject",
    "descriptor_v1",
    "descriptor_v2",
}
V1_KINDS = {"open", "ready", "cancel", "reject", "descriptor_v1"}


def _tag(msg: Message) -> str:
    return type(msg).__struct_config__.tag  # type: ignore[attr-defined, no-any-return]


# --- round trips ------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(s.messages())
def test_round_trip_every_kind(msg: Message) -> None:
    frame = encode_frame(msg)
    assert decode_frame(frame) == msg
    assert decode_frame(frame, version=CURRENT_VERSION) == msg
    # Deterministic: same message, same bytes; and the decoded copy re-encodes identically.
    assert encode_frame(msg) == frame
    assert encode_frame(decode_frame(frame)) == frame


@pytest.mark.parametrize("msg_type", list(s.MESSAGE_STRATEGIES), ids=lambda t: t.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_round_trip_per_kind(msg_type: type, data: st.DataObject) -> None:
    # The union strategy could under-sample a kind; this pins each one.
    msg = data.draw(s.MESSAGE_STRATEGIES[msg_type])
    assert type(msg) is msg_type
    assert decode_frame(encode_frame(msg)) == msg


@settings(max_examples=60, deadline=None)
@given(s.messages(version=1))
def test_round_trip_v1(msg: Message) -> None:
    frame = encode_frame(msg, version=1)
    assert frame[4] == 1
    assert decode_frame(frame, version=1) == msg
    assert _tag(msg) in V1_KINDS


@settings(max_examples=100, deadline=None)
@given(s.tickets())
def test_ticket_round_trip(ticket: ContextTicket) -> None:
    # Tickets survive every hop unchanged: inside a frame and on their own.
    encoded = msgspec.msgpack.encode(ticket)
    assert msgspec.msgpack.decode(encoded, type=ContextTicket) == ticket
    frame = encode_frame(Receipt(ticket=ticket, bytes_received=1))
    decoded = decode_frame(frame)
    assert isinstance(decoded, Receipt)
    assert decoded.ticket == ticket
    assert decoded.ticket.edge == ticket.edge
    assert decoded.ticket.parent == ticket.parent
    assert hash(decoded.ticket) == hash(ticket)


# --- samples and the kind table ----------------------------------------------


def test_samples_cover_every_kind_once_and_are_deterministic() -> None:
    got = samples()
    assert {_tag(m) for m in got} == ALL_KINDS
    assert len(got) == len(ALL_KINDS)
    assert got == samples()
    assert [encode_frame(m) for m in got] == [encode_frame(m) for m in samples()]
    for msg in got:
        assert decode_frame(encode_frame(msg)) == msg


def test_kind_codes_are_distinct_and_in_header() -> None:
    codes = {kind_code(type(m)) for m in samples()}
    assert len(codes) == len(ALL_KINDS)
    assert 0 not in codes
    for msg in samples():
        frame = encode_frame(msg)
        assert frame[:4] == FRAME_MAGIC
        assert frame[4] == CURRENT_VERSION
        assert frame[5] == kind_code(type(msg))
        assert frame[6:8] == b"\x00\x00"
        assert int.from_bytes(frame[8:12], "big") == len(frame) - FRAME_HEADER_LEN
    with pytest.raises(FrameError):
        kind_code(dict)


def test_version_table() -> None:
    assert SUPPORTED_VERSIONS == (1, 2)
    assert CURRENT_VERSION == 2
    assert allowed_kinds(1) == V1_KINDS
    assert allowed_kinds(2) == ALL_KINDS
    for bad in (0, 3, True, "2"):
        with pytest.raises(FrameError):
            allowed_kinds(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", samples(), ids=_tag)
def test_encode_refuses_kinds_outside_the_version(msg: Message) -> None:
    if _tag(msg) in V1_KINDS:
        frame = encode_frame(msg, version=1)
        assert decode_frame(frame, version=1) == msg
        # A v1 frame is refused once v2 was negotiated, and vice versa.
        with pytest.raises(FrameError, match="negotiated"):
            decode_frame(frame, version=2)
        with pytest.raises(FrameError, match="negotiated"):
            decode_frame(encode_frame(msg, version=2), version=1)
    else:
        with pytest.raises(FrameError, match="not allowed in protocol v1"):
            encode_frame(msg, version=1)


def test_encode_refuses_bad_versions_and_non_messages() -> None:
    msg = samples()[1]
    for bad in (0, 3, 255, True, None):
        with pytest.raises(FrameError):
            encode_frame(msg, version=bad)  # type: ignore[arg-type]
    for not_a_message in (None, b"x", {"kind": "ready"}, samples()[0].ticket):
        with pytest.raises(FrameError):
            encode_frame(not_a_message)  # type: ignore[arg-type]


def test_encode_wraps_unencodable_values() -> None:
    # Structs are not validated on construction; an int past 64 bits cannot
    # be encoded and must surface as FrameError, not OverflowError.
    msg = Receipt(ticket=samples()[0].ticket, bytes_received=2**70)  # type: ignore[union-attr]
    with pytest.raises(FrameError, match="cannot encode"):
        encode_frame(msg)


def test_decode_rejects_kind_forbidden_in_frame_version() -> None:
    # A hand-built v1 header over a terminal body: refused structurally.
    terminal = next(m for m in samples() if isinstance(m, Terminal))
    frame = bytearray(encode_frame(terminal))
    frame[4] = 1
    with pytest.raises(FrameError, match="not allowed in protocol v1"):
        decode_frame(bytes(frame))


def test_decode_checks_negotiated_version_argument() -> None:
    frame = encode_frame(samples()[0])
    for bad in (0, 3, True):
        with pytest.raises(FrameError):
            decode_frame(frame, version=bad)


# --- buffers ------------------------------------------------------------------


def test_decode_accepts_every_byte_buffer_and_copies() -> None:
    msg = samples()[0]
    frame = encode_frame(msg)
    buf = bytearray(frame)
    assert decode_frame(buf) == msg
    assert decode_frame(memoryview(frame)) == msg
    # A view of a larger buffer (zero-copy slice of a receive buffer).
    big = b"\xff" * 7 + frame + b"\xee" * 5
    assert decode_frame(memoryview(big)[7 : 7 + len(frame)]) == msg
    # A view with another item format is read as its raw bytes.
    signed = array.array("b", frame)
    assert memoryview(signed).format == "b"
    assert decode_frame(memoryview(signed)) == msg
    # The message shares no memory with the buffer: reusing it changes nothing.
    decoded = decode_frame(buf)
    buf[:] = b"\x00" * len(buf)
    assert decoded == msg


def test_decode_refuses_non_buffers() -> None:
    frame = encode_frame(samples()[1])
    for bad in (frame.decode("latin-1"), None, 42, list(frame), memoryview(frame)[::2]):
        with pytest.raises(FrameError):
            decode_frame(bad)  # type: ignore[arg-type]
    released = memoryview(frame)
    released.release()
    with pytest.raises(FrameError):
        decode_frame(released)


# --- the cap --------------------------------------------------------------------


def test_worst_case_open_fits_the_cap() -> None:
    # The largest legal message: every field at its bound, every int at its widest.
    msg = s.worst_case_open()
    frame = encode_frame(msg)
    # The wire module docstring's arithmetic: 29 bytes per block + ~1.5 KiB of ticket.
    assert 16384 * 29 < len(frame) < 16384 * 29 + 3 * 1024
    assert len(frame) <= MAX_FRAME_LEN
    assert decode_frame(frame) == msg
    # One block more is refused by the schema, on either side of the wire.
    with pytest.raises(ProtocolError):
        decode_frame(encode_frame(s.worst_case_open(MAX_BLOCKS_PER_OPEN + 1)))


def _packed(msg: Open) -> Open:
    c = block_columns(msg.buffer)
    packed = pack_blocks(c.blocks, c.lengths, c.generations, c.addrs)
    return msgspec.structs.replace(msg, buffer=msgspec.structs.replace(msg.buffer, blocks=packed))


def test_a_packed_open_round_trips_and_reads_as_its_list_form() -> None:
    listed = samples()[0]
    assert isinstance(listed, Open)
    packed = _packed(listed)
    assert isinstance(packed.buffer.blocks, bytes) and len(packed.buffer.blocks) == 4 * PACKED_BLOCK_BYTES
    got = decode_frame(encode_frame(packed))
    assert got == packed and isinstance(got, Open)
    assert got.buffer.num_blocks == listed.buffer.num_blocks == 4
    for mine, theirs in zip(block_columns(got.buffer), block_columns(listed.buffer)):
        assert mine.tolist() == theirs.tolist()
    assert [d.addr for d in listed.buffer.blocks] == block_columns(got.buffer).addrs.tolist()


def _as_runs(msg: Open, length: int) -> Open:
    c = block_columns(msg.buffer)
    runs = pack_runs(c.blocks, c.generations, c.addrs, length)
    assert runs is not None
    return msgspec.structs.replace(msg, buffer=msgspec.structs.replace(msg.buffer, blocks=runs))


def test_an_open_of_runs_round_trips_and_reads_as_its_list_form() -> None:
    """A lease of 8,192 blocks in three runs (the pool's order wrapped
    round, one block leased again since): 72 bytes of runs where the packed
    form takes 196,608, and the same columns once read."""
    listed = s.worst_case_open(8192)
    blocks = np.r_[np.arange(9000, 16000), np.arange(0, 1191), [20000]]
    generations = np.r_[np.full(7000, 3), np.full(1191, 4), [7]]
    descriptors = [
        BlockDescriptor(int(b), int(g), (1 << 20) + int(b) * 256, 256) for b, g in zip(blocks, generations)
    ]
    listed = msgspec.structs.replace(listed, buffer=msgspec.structs.replace(listed.buffer, blocks=descriptors))
    runs = _as_runs(listed, 256)
    assert isinstance(runs.buffer.blocks, BlockRuns) and len(runs.buffer.blocks.runs) == 3 * RUN_BYTES
    frame = encode_frame(runs)
    assert len(frame) < 4096  # the ticket and agent name of the worst case; the packed form: 196 KiB more
    got = decode_frame(frame)
    assert got == runs and isinstance(got, Open) and got.buffer.num_blocks == 8192
    for mine, theirs in zip(block_columns(got.buffer), block_columns(listed.buffer)):
        assert mine.tolist() == theirs.tolist()
    assert not block_columns(got.buffer).blocks.flags.writeable


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=12))
def test_runs_name_exactly_the_blocks_they_were_made_of(pieces: list[tuple[int, int, int]]) -> None:
    """Any block list (runs of any length, generation and place, joined
    or not) reads back the same through `pack_runs`, or stays packed when
    its runs would not halve it."""
    blocks = np.concatenate([np.arange(first, first + n) for first, n, _ in pieces])
    generations = np.concatenate([np.full(n, g) for _, n, g in pieces]).astype(np.uint64)
    addrs = (4096 + blocks * 128).astype(np.uint64)
    runs = pack_runs(blocks, generations, addrs, 128)
    if runs is None:
        return
    assert 2 * (len(runs.runs) // RUN_BYTES) <= len(blocks)
    buffer = BufferInfo(agent_name="a", endpoint_epoch=1, memory=MemoryKind.DRAM, blocks=runs)
    cols = block_columns(buffer)
    assert cols.blocks.tolist() == blocks.tolist()
    assert cols.generations.tolist() == generations.tolist()
    assert cols.addrs.tolist() == addrs.tolist()
    assert set(cols.lengths.tolist()) == {128} and buffer.num_blocks == len(blocks)


def test_worst_case_packed_open_fits_the_cap_and_decodes_in_one_copy() -> None:
    listed = s.worst_case_open()
    packed = _packed(listed)
    frame = encode_frame(packed)
    assert MAX_BLOCKS_PER_OPEN * PACKED_BLOCK_BYTES < len(frame) <= MAX_FRAME_LEN
    got = decode_frame(frame)
    assert got == packed
    cols = block_columns(got.buffer)  # type: ignore[union-attr]
    assert cols.generations.max() == cols.addrs.max() == 2**63 - 1
    assert cols.blocks.max() == cols.lengths.max() == 2**32 - 1
    # The arrays are views of the message's own bytes: nothing per block was built.
    assert cols.blocks.base is not None and not cols.blocks.flags.writeable


def test_max_len_argument_is_a_hard_cap() -> None:
    frame = encode_frame(samples()[0])
    assert decode_frame(frame, max_len=len(frame)) == samples()[0]
    with pytest.raises(FrameError, match="exceeds the cap"):
        decode_frame(frame, max_len=len(frame) - 1)


def test_encode_refuses_a_body_over_the_cap() -> None:
    # 16384 is the schema bound; a locally built OPEN far past it would exceed
    # the frame cap and must be refused before it is sent.
    msg = s.worst_case_open(blocks=40_000)
    with pytest.raises(FrameError, match="exceeds the cap"):
        encode_frame(msg)


# --- errors ---------------------------------------------------------------------


def test_protocol_error_is_abstract() -> None:
    with pytest.raises(TypeError):
        ProtocolError("x")
    assert issubclass(FrameError, ProtocolError)
    assert issubclass(DecodeError, ProtocolError)
    assert isinstance(FrameError("x"), ProtocolError)


def test_descriptor_frames_decode_without_a_negotiated_version() -> None:
    # Descriptors travel before negotiation: version=None accepts v1 and v2 frames.
    v1 = RankDescriptorV1(version=1, capabilities=3)
    v2 = RankDescriptorV2(versions=[1, 2], capabilities=31, abi="msgpack-v1")
    assert decode_frame(encode_frame(v1, version=1)) == v1
    assert decode_frame(encode_frame(v2)) == v2


def test_wire_and_negotiation_names_are_public() -> None:
    import kvhandoff.protocol as protocol

    for name in (
        "encode_frame",
        "decode_frame",
        "samples",
        "kind_code",
        "allowed_kinds",
        "MAX_FRAME_LEN",
        "FRAME_HEADER_LEN",
        "FRAME_MAGIC",
        "CURRENT_VERSION",
        "SUPPORTED_VERSIONS",
        "negotiate",
        "require",
        "local_descriptor",
        "DEFAULT_DESCRIPTOR",
        "Negotiated",
        "ABI_MSGPACK_V1",
    ):
        assert name in protocol.__all__, name
