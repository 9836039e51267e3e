"""Control-plane messages (docs/design.md "Messages").

Messages are data: frozen, keyword-only msgspec Structs that forbid unknown
fields, each tagged with its kind so one union decoder types them. Every
variable-length field is bounded (`Meta(max_length=...)`) so decoding cost and
retained state are bounded by the frame length cap. Schema evolution is
append-only with defaults.

An OPEN's block list comes in two forms. The list form is one
`BlockDescriptor` per block (every build reads it). The packed form
(`Capability.PACKED_BLOCKS`, sent only to a topology that negotiated it) is one
byte string of four little-endian columns: block (u32) x n, length (u32) x n,
generation (u64) x n, address (u64) x n, 24 bytes per block. The packed form
decodes as one copy and is read as arrays (`block_columns`), so an OPEN of
8,192 blocks costs no per-block object on either side. The run form
(`Capability.BLOCK_RUNS`, `BlockRuns`) names runs of consecutive blocks of one
generation at evenly spaced addresses, 24 bytes per run: a pool hands out its
free blocks in order, so a large lease is a few runs, and its OPEN stays a few
hundred bytes instead of 24 bytes a block (8,192 blocks: 196 KiB, past the
size Ray passes inline with a call).

| message | from → to | meaning |
| --- | --- | --- |
| Open | GEN rank → CTX rank | proposal for one edge, with the full buffer info |
| Ready | CTX rank → GEN rank | the CTX topology decided and installed the session |
| Cancel | either → peer | cancel one exact installed session |
| Terminal | CTX rank → GEN rank | terminal evidence for the edge |
| Receipt | GEN rank → CTX rank | bytes acknowledged (not memory quiescence) |
| Reject | either | a proposal refused, with a typed reason |
| RankDescriptorV1/V2 | rank → all | negotiation: versions, capabilities, ABI |
"""

from __future__ import annotations

import enum
from typing import Annotated, NamedTuple, Union

import msgspec
import numpy as np
from msgspec import Meta

from ._ticket import U32, U63, ContextTicket

__all__ = [
    "MAX_BLOCKS_PER_OPEN",
    "MAX_DETAIL_LEN",
    "MAX_AGENT_NAME_LEN",
    "MemoryKind",
    "TerminalKind",
    "CancelReason",
    "RejectReason",
    "Capability",
    "BlockDescriptor",
    "BlockColumns",
    "PACKED_BLOCK_BYTES",
    "pack_blocks",
    "RUN_BYTES",
    "BlockRuns",
    "pack_runs",
    "block_columns",
    "BufferInfo",
    "Open",
    "Ready",
    "Cancel",
    "Terminal",
    "Receipt",
    "Reject",
    "RankDescriptorV1",
    "RankDescriptorV2",
    "Message",
    "SessionMessage",
]

#: Most GEN blocks one OPEN may describe (bounds decode work and state).
MAX_BLOCKS_PER_OPEN = 16384
#: Bytes per block in the packed form of `BufferInfo.blocks`.
PACKED_BLOCK_BYTES = 24
#: Longest free-text detail a REJECT or CANCEL may carry.
MAX_DETAIL_LEN = 256
#: Longest NIXL agent name.
MAX_AGENT_NAME_LEN = 128

U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # msgspec bounds fit int64
Detail = Annotated[str, Meta(max_length=MAX_DETAIL_LEN)]


class MemoryKind(str, enum.Enum):
    DRAM = "DRAM"  # host memory
    VRAM = "VRAM"  # GPU memory


class TerminalKind(str, enum.Enum):
    COMPLETED = "completed"  # every byte of the edge was written (bytes says how many)
    NOT_STARTED = "not_started"  # no DMA was ever posted for the edge
    DRAINED = "drained"  # posted DMA was polled to DONE/ERR; nothing is in flight
    UNKNOWN = "unknown"  # quiescence could not be proven: quarantine


class CancelReason(str, enum.Enum):
    CLIENT = "client"  # the user cancelled the request
    PEER = "peer"  # a sibling edge or the peer side cancelled
    TIMEOUT = "timeout"  # a deadline (lease, transfer, round) expired
    FAILURE = "failure"  # a rank failed or a transfer errored
    SHUTDOWN = "shutdown"  # the deployment is stopping


class RejectReason(str, enum.Enum):
    STALE = "stale"  # older attempt / epoch / generation / digest
    UNKNOWN_SESSION = "unknown_session"  # nothing installed under that ticket
    NO_CAPACITY = "no_capacity"  # no blocks to lease
    BAD_BUFFER_INFO = "bad_buffer_info"  # descriptors do not match the layout
    UNQUALIFIED = "unqualified"  # the topology is outside the qualified scope
    NEGOTIATION = "negotiation"  # no common protocol
    ADMISSION_STOPPED = "admission_stopped"  # topology stopped admitting (watchdog)
    DUPLICATE = "duplicate"  # the session already exists


class Capability(enum.IntFlag):
    INFLIGHT_CANCEL = 1 << 0  # cancel while DMA is in flight (drain, not wait)
    TERMINAL_V1 = 1 << 1  # role-specific TERMINAL evidence
    OPEN_CARRIES_BUFFER_INFO = 1 << 2  # OPEN carries complete BufferInfo
    CHUNKED_WRITE = 1 << 3  # DMA posted in chunks (cancel stops between chunks)
    STAGED_WRITE = 1 << 4  # gather/scatter through staging slots
    PACKED_BLOCKS = 1 << 5  # an OPEN's block list may come packed (columns of bytes)
    BLOCK_RUNS = 1 << 6  # an OPEN's block list may come as runs of consecutive blocks
    PULL = 1 << 7  # the GEN rank READs blocks a CTX rank lent it (no OPEN, no READY)


class _Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class BlockDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One destination block: index and slot generation (ABA-safe), and where it lives."""

    block: U32
    generation: U63
    addr: U64
    length: U32


_I63 = 2**63  # generations and addresses stay below, as in `BlockDescriptor`

#: Bytes per run in `BlockRuns.runs`.
RUN_BYTES = 24


class BlockRuns(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An OPEN's blocks as runs (`Capability.BLOCK_RUNS`). Run i is `count`
    consecutive blocks from `first`, all of one `generation`, the first at
    `addr` and each next one `stride` bytes further; every block is
    `length` bytes. `runs` holds four little-endian columns, one entry per
    run: first (u32), count (u32), generation (u64), addr (u64).

    Checked on decode as the other forms are by their schema, before any
    expansion: every count at least 1 and their sum at most
    `MAX_BLOCKS_PER_OPEN`, every block index below 2**32, every generation
    and every block's address below 2**63."""

    length: U32
    stride: U63
    runs: Annotated[bytes, Meta(min_length=RUN_BYTES, max_length=MAX_BLOCKS_PER_OPEN * RUN_BYTES)]

    def __post_init__(self) -> None:
        if len(self.runs) % RUN_BYTES:
            raise ValueError(f"runs of {len(self.runs)} bytes, not a multiple of {RUN_BYTES}")
        first, count, generation, addr = _run_columns(self)
        if (count == 0).any():
            raise ValueError("a run of no block")
        if int(count.sum(dtype=np.uint64)) > MAX_BLOCKS_PER_OPEN:
            raise ValueError(f"runs of more than {MAX_BLOCKS_PER_OPEN} blocks")
        last = first.astype(np.uint64) + count.astype(np.uint64) - np.uint64(1)
        if (last >= np.uint64(2**32)).any():
            raise ValueError("a run's last block index is not below 2**32")
        if (generation >= _I63).any() or (addr >= _I63).any():
            raise ValueError("a run's generation or first address is not below 2**63")
        # The last address of each run, addr + (count - 1) * stride, below
        # 2**63 too, checked without overflow: (count - 1) * stride <= room.
        room = np.uint64(_I63 - 1) - addr
        steps = count.astype(np.uint64) - np.uint64(1)
        if self.stride and (steps > room // np.uint64(self.stride)).any():
            raise ValueError("a run's last address is not below 2**63")

    @property
    def num_blocks(self) -> int:
        return int(_run_columns(self)[1].sum(dtype=np.uint64))


def _run_columns(runs: BlockRuns) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    raw = runs.runs
    r = len(raw) // RUN_BYTES
    return (
        np.frombuffer(raw, dtype="<u4", count=r, offset=0),
        np.frombuffer(raw, dtype="<u4", count=r, offset=4 * r),
        np.frombuffer(raw, dtype="<u8", count=r, offset=8 * r),
        np.frombuffer(raw, dtype="<u8", count=r, offset=16 * r),
    )


def pack_runs(blocks: np.ndarray, generations: np.ndarray, addrs: np.ndarray, length: int) -> BlockRuns | None:
    """`blocks` (with their generations and addresses, every block `length`
    bytes) as runs, or None when runs would not take at most half the
    packed form's bytes (blocks scattered over the pool: send them packed).
    The stride is the address step of the first two consecutive blocks."""
    n = len(blocks)
    if n == 0 or not n == len(generations) == len(addrs):
        return None
    b = np.asarray(blocks, dtype=np.int64)
    g = np.asarray(generations, dtype=np.uint64)
    a = np.asarray(addrs, dtype=np.uint64)
    step = np.diff(b) == 1
    adjacent = np.flatnonzero(step)
    stride = np.uint64(a[adjacent[0] + 1] - a[adjacent[0]]) if len(adjacent) else np.uint64(length)
    if int(stride) >= _I63:
        return None
    joined = step & (g[1:] == g[:-1]) & (a[1:] - a[:-1] == stride)
    starts = np.concatenate(([0], np.flatnonzero(~joined) + 1))
    if 2 * len(starts) > n:
        return None
    counts = np.diff(np.concatenate((starts, [n])))
    raw = b"".join(
        (
            b[starts].astype("<u4").tobytes(),
            counts.astype("<u4").tobytes(),
            g[starts].astype("<u8").tobytes(),
            a[starts].astype("<u8").tobytes(),
        )
    )
    return BlockRuns(length=length, stride=int(stride), runs=raw)


class BufferInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """RequestAndBufferInfo: what CTX needs to write into one GEN rank's blocks.

    `blocks` is a list of descriptors, `pack_blocks`' bytes or `BlockRuns`;
    read any form with `block_columns`."""

    agent_name: Annotated[str, Meta(min_length=1, max_length=MAX_AGENT_NAME_LEN)]
    endpoint_epoch: U63
    memory: MemoryKind
    device: Annotated[int, Meta(ge=0, lt=1024)] = 0
    blocks: Union[
        Annotated[list[BlockDescriptor], Meta(min_length=1, max_length=MAX_BLOCKS_PER_OPEN)],
        Annotated[
            bytes,
            Meta(min_length=PACKED_BLOCK_BYTES, max_length=MAX_BLOCKS_PER_OPEN * PACKED_BLOCK_BYTES),
        ],
        BlockRuns,
    ]

    def __post_init__(self) -> None:
        # A packed list is checked as the list form is by its schema: whole
        # blocks, every generation and address below 2**63. (Run on decode
        # too: a bad packed list is a DecodeError, like a bad descriptor.)
        if isinstance(self.blocks, bytes):
            if len(self.blocks) % PACKED_BLOCK_BYTES:
                raise ValueError(
                    f"packed blocks of {len(self.blocks)} bytes, not a multiple of {PACKED_BLOCK_BYTES}"
                )
            cols = block_columns(self)
            if (cols.generations >= _I63).any() or (cols.addrs >= _I63).any():
                raise ValueError("a packed generation or address is not below 2**63")

    @property
    def num_blocks(self) -> int:
        """How many blocks the OPEN names, in either form."""
        if isinstance(self.blocks, bytes):
            return len(self.blocks) // PACKED_BLOCK_BYTES
        if isinstance(self.blocks, BlockRuns):
            return self.blocks.num_blocks
        return len(self.blocks)


class BlockColumns(NamedTuple):
    """An OPEN's blocks as read-only arrays, one entry per block, in order."""

    blocks: np.ndarray  # uint32
    lengths: np.ndarray  # uint32
    generations: np.ndarray  # uint64
    addrs: np.ndarray  # uint64


def pack_blocks(blocks: np.ndarray, lengths: np.ndarray, generations: np.ndarray, addrs: np.ndarray) -> bytes:
    """The packed form of a block list (four equal-length columns)."""
    n = len(blocks)
    if not n == len(lengths) == len(generations) == len(addrs):
        raise ValueError("pack_blocks needs four columns of one length")
    return b"".join(
        (
            np.asarray(blocks, dtype="<u4").tobytes(),
            np.asarray(lengths, dtype="<u4").tobytes(),
            np.asarray(generations, dtype="<u8").tobytes(),
            np.asarray(addrs, dtype="<u8").tobytes(),
        )
    )


def block_columns(buffer: BufferInfo) -> BlockColumns:
    """`buffer`'s blocks as columns, from any form (views of the packed
    bytes; runs expanded with a few array operations)."""
    raw = buffer.blocks
    if isinstance(raw, BlockRuns):
        return _expand_runs(raw)
    if isinstance(raw, bytes):
        n = len(raw) // PACKED_BLOCK_BYTES
        return BlockColumns(
            np.frombuffer(raw, dtype="<u4", count=n, offset=0),
            np.frombuffer(raw, dtype="<u4", count=n, offset=4 * n),
            np.frombuffer(raw, dtype="<u8", count=n, offset=8 * n),
            np.frombuffer(raw, dtype="<u8", count=n, offset=16 * n),
        )
    n = len(raw)
    return BlockColumns(
        np.fromiter((d.block for d in raw), dtype=np.uint32, count=n),
        np.fromiter((d.length for d in raw), dtype=np.uint32, count=n),
        np.fromiter((d.generation for d in raw), dtype=np.uint64, count=n),
        np.fromiter((d.addr for d in raw), dtype=np.uint64, count=n),
    )


def _expand_runs(runs: BlockRuns) -> BlockColumns:
    first, count, generation, addr = _run_columns(runs)
    n = int(count.sum(dtype=np.uint64))
    which = np.repeat(np.arange(len(count)), count)
    offsets = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(count, dtype=np.int64) - count, count)
    columns = BlockColumns(
        (first.astype(np.int64)[which] + offsets).astype(np.uint32),
        np.full(n, runs.length, dtype=np.uint32),
        generation[which],
        addr[which] + offsets.astype(np.uint64) * np.uint64(runs.stride),
    )
    for column in columns:
        column.setflags(write=False)
    return columns


class Open(_Msg, frozen=True, tag="open"):
    ticket: ContextTicket
    buffer: BufferInfo
    num_tokens: U32


class Ready(_Msg, frozen=True, tag="ready"):
    ticket: ContextTicket
    #: Reserved: no build sets it (a READY follows the decision of a round
    #: or of an admission at the OPEN, and the GEN side needs neither's
    #: number). It stays in the schema because every build encodes it (0)
    #: and the schema refuses unknown fields: removing it would make this
    #: build refuse the READY of every earlier one.
    round_no: U63 = 0


class Cancel(_Msg, frozen=True, tag="cancel"):
    ticket: ContextTicket
    reason: CancelReason
    detail: Detail = ""
    #: Pull: the CTX rank's number for the lend this CANCEL fences a reader
    #: off (0: a push session's CANCEL).
    lend_seq: U63 = 0


class Terminal(_Msg, frozen=True, tag="terminal"):
    ticket: ContextTicket
    evidence: TerminalKind
    bytes_done: U64 = 0


class Receipt(_Msg, frozen=True, tag="receipt"):
    ticket: ContextTicket
    bytes_received: U64


class Reject(_Msg, frozen=True, tag="reject"):
    ticket: ContextTicket
    reason: RejectReason
    detail: Detail = ""


class RankDescriptorV1(_Msg, frozen=True, tag="descriptor_v1"):
    """v1 descriptor: one protocol version and a capability bit set."""

    version: Annotated[int, Meta(ge=1, le=255)]
    capabilities: U32


class RankDescriptorV2(_Msg, frozen=True, tag="descriptor_v2"):
    """v2 descriptor: every supported version, capabilities, serialization ABI."""

    versions: Annotated[list[Annotated[int, Meta(ge=1, le=255)]], Meta(min_length=1, max_length=16)]
    capabilities: U32
    abi: Annotated[str, Meta(min_length=1, max_length=64)]


#: Messages that name one edge session by its ticket.
SessionMessage = Union[Open, Ready, Cancel, Terminal, Receipt, Reject]
#: Every control-plane message.
Message = Union[Open, Ready, Cancel, Terminal, Receipt, Reject, RankDescriptorV1, RankDescriptorV2]


