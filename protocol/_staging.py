"""Staging slots: the bounce buffers of the staged data plane (docs/design.md
"Staged data plane").

A CTX rank gathers one chunk of an edge's small pieces into a slot of its own
staging arena, moves the slot with ONE WRITE into the matching slot of the GEN
rank's arena, and the GEN rank scatters the slot into its blocks when the
WRITE's notification proves the bytes landed. Each (CTX rank, GEN rank) pair
owns a fixed partition of `window` slot pairs (a CTX slot and the GEN slot it
writes), so only one writer ever targets a GEN slot.

A slot is a leased resource like a block (S1 applies to slots):

- `StagingSlots` is the writer's table of its partition toward one GEN rank.
  A slot goes FREE -> WRITING (`acquire`: gathered, its WRITE posted) ->
  LANDED (`landed`: the WRITE is DONE, the reader may be scattering) -> FREE
  (`freed`: the reader's ACK, or the WRITE ended in ERR) with its generation
  one higher. A slot is never acquired while a WRITE may land in it or the
  reader may still read it.
- Every reference is `(slot, generation)`: an ACK or notice about an older
  generation is refused (`StaleSlotError`), never applied to the slot's next
  use (ABA-safe).
- A LANDED slot whose ACK does not come within its deadline is
  QUARANTINED: it is not reused (its reader may still read it) and does not
  wedge the table: the other slots go on, and a table with no usable slot
  makes the writer post directly. `reclaim_peer` frees the quarantined and
  LANDED slots when the reader is proven gone (its agent was replaced), with
  their generations bumped; WRITING slots drain like chunks (`freed` once
  their WRITE is polled to DONE/ERR).
- `SlotGuard` is the reader's side: per writer agent, the newest generation
  seen per slot; a replayed or reordered notice for an older generation is
  refused, so a slot is scattered at most once per generation.

`StageWrite` / `StageAck` are the two notifications (msgspec, array-like,
prefixed by `STAGE_MAGIC`); `decode_stage` checks the length before decoding
and raises only `DecodeError`. Pure: no clock reads (time is an argument).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ._errors import DecodeError, ProtocolError

__all__ = [
    "SlotState",
    "SlotRef",
    "StaleSlotError",
    "SlotError",
    "StagingSlots",
    "SlotGuard",
    "StageWrite",
    "StageAck",
    "STAGE_MAGIC",
    "MAX_STAGE_LEN",
    "encode_stage",
    "decode_stage",
]

#: The first bytes of every staging notification (control frames start with
#: another magic; a receiver tells them apart before decoding either).
STAGE_MAGIC = b"KVS1"
#: The longest staging notification accepted (checked before decoding).
MAX_STAGE_LEN = 512

_U32 = Annotated[int, Meta(ge=0, lt=1 << 32)]
_U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # msgspec bounds fit int64
_Id = Annotated[str, Meta(min_length=1, max_length=128)]


class StageWrite(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag="w"):
    """Writer -> reader, carried by the slot's WRITE: `slot` (generation
    `generation`) holds rows `[start, end)` of the edge's transfer order
    (row k = pair k // pieces, piece k % pieces), `nbytes` in all, for the
    session of (request_id, ctx_attempt, gen_attempt) from CTX rank
    `ctx_rank` epoch `ctx_epoch`; `max_piece` is the cut the writer's pieces
    were made with, `chunk` the protocol's chunk index."""

    request_id: _Id
    ctx_attempt: _U32
    gen_attempt: _U32
    ctx_rank: _U32
    ctx_epoch: _U64
    chunk: _U32
    start: _U64
    end: _U64
    max_piece: _U64
    slot: _U32
    generation: _U64
    nbytes: _U64


class StageAck(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True, tag="a"):
    """Reader -> writer: the reader is done with `slot` at `generation`.
    `scattered`: the bytes went into the session's blocks (False: the lease
    had ended, or the notice was refused; nothing was written)."""

    slot: _U32
    generation: _U64
    scattered: bool


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StageWrite | StageAck)


def encode_stage(message: StageWrite | StageAck) -> bytes:
    return STAGE_MAGIC + _ENCODER.encode(message)


def decode_stage(payload: object) -> StageWrite | StageAck:
    """Bounded, typed: `DecodeError` for anything but one well-formed notice."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError(f"a staging notice is bytes, not {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) > MAX_STAGE_LEN:
        raise DecodeError(f"staging notice of {len(payload)} bytes, at most {MAX_STAGE_LEN}")
    if payload[: len(STAGE_MAGIC)] != STAGE_MAGIC:
        raise DecodeError("not a staging notice (magic)")
    try:
        return _DECODER.decode(payload[len(STAGE_MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise DecodeError(f"undecodable staging notice: {exc}") from exc


class SlotError(ProtocolError):
    """A slot operation that does not fit the slot's state or the table
    (out of range, not in the state the call needs). Nothing was changed."""


class StaleSlotError(SlotError):
    """A reference to an older generation of a slot (a late or replayed ACK,
    a notice about a previous use). Nothing was changed."""


class SlotState(str, enum.Enum):
    FREE = "free"
    WRITING = "writing"  # gathered, its WRITE posted and not yet DONE/ERR
    LANDED = "landed"  # WRITE DONE: the reader may be scattering it
    QUARANTINED = "quarantined"  # LANDED, no ACK within its deadline


@dataclass(frozen=True)
class SlotRef:
    slot: int
    generation: int


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    generation: int = 0
    owner: Any = None
    deadline: float = 0.0


class StagingSlots:
    """The writer's table of its slot partition toward one reader (above)."""

    def __init__(self, window: int) -> None:
        if not isinstance(window, int) or window <= 0:
            raise SlotError(f"window must be a positive int, got {window!r}")
        self._slots = [_Slot() for _ in range(window)]
        self._free = list(range(window - 1, -1, -1))  # pop() gives the lowest first

    def __len__(self) -> int:
        return len(self._slots)

    def _get(self, ref: SlotRef, *states: SlotState) -> _Slot:
        if not isinstance(ref, SlotRef) or not 0 <= ref.slot < len(self._slots):
            raise SlotError(f"no slot {ref!r} in a table of {len(self._slots)}")
        s = self._slots[ref.slot]
        if s.generation != ref.generation:
            raise StaleSlotError(f"slot {ref.slot} is at generation {s.generation}, not {ref.generation}")
        if s.state not in states:
            raise SlotError(f"slot {ref.slot} is {s.state.value}, not {'/'.join(x.value for x in states)}")
        return s

    def acquire(self, owner: Any) -> SlotRef | None:
        """A FREE slot for `owner` (now WRITING), or None when none is free."""
        if not self._free:
            return None
        i = self._free.pop()
        s = self._slots[i]
        s.state, s.owner = SlotState.WRITING, owner
        return SlotRef(i, s.generation)

    def landed(self, ref: SlotRef, deadline: float) -> None:
        """WRITING -> LANDED: the WRITE is DONE; the ACK is due by `deadline`."""
        s = self._get(ref, SlotState.WRITING)
        s.state, s.deadline = SlotState.LANDED, deadline

    def freed(self, ref: SlotRef) -> Any:
        """The reader ACKed (LANDED, or QUARANTINED: a late ACK is the proof),
        or the WRITE ended in ERR (WRITING: no notice was sent, the reader
        never reads it) -> FREE at the next generation. Returns the owner."""
        s = self._get(ref, SlotState.WRITING, SlotState.LANDED, SlotState.QUARANTINED)
        owner = s.owner
        self._release(ref.slot)
        return owner

    def _release(self, i: int) -> None:
        s = self._slots[i]
        s.state, s.owner, s.deadline = SlotState.FREE, None, 0.0
        s.generation += 1
        self._free.append(i)

    def expire(self, now: float) -> list[tuple[SlotRef, Any]]:
        """LANDED slots past their ACK deadline -> QUARANTINED (the reader may
        still be reading them: never reused until an ACK or `reclaim_peer`).
        Returns them with their owners (their chunks are over: report them)."""
        out = []
        for i, s in enumerate(self._slots):
            if s.state is SlotState.LANDED and now >= s.deadline:
                s.state = SlotState.QUARANTINED
                out.append((SlotRef(i, s.generation), s.owner))
        return out

    def reclaim_peer(self) -> list[tuple[SlotRef, Any]]:
        """The reader is gone (its agent was replaced or confirmed dead):
        LANDED and QUARANTINED slots -> FREE (nobody reads them any more).
        WRITING slots stay: their WRITE is still polled to DONE/ERR, and
        `freed` or a later `reclaim_peer` ends them. Returns what was freed
        (with the refs they had) and their owners."""
        out = []
        for i, s in enumerate(self._slots):
            if s.state in (SlotState.LANDED, SlotState.QUARANTINED):
                out.append((SlotRef(i, s.generation), s.owner))
                self._release(i)
        return out

    def owner(self, ref: SlotRef) -> Any:
        return self._get(ref, SlotState.WRITING, SlotState.LANDED, SlotState.QUARANTINED).owner

    def state(self, slot: int) -> tuple[SlotState, int]:
        s = self._slots[slot]
        return s.state, s.generation

    def counts(self) -> dict[str, int]:
        out = {st.value: 0 for st in SlotState}
        for s in self._slots:
            out[s.state.value] += 1
        return out

    @property
    def usable(self) -> bool:
        """Whether a slot is or will become free without a reclaim (not all quarantined)."""
        return any(s.state is not SlotState.QUARANTINED for s in self._slots)

    def check_invariants(self) -> None:
        """Every slot is FREE exactly when it is in the free list, once."""
        free = [i for i, s in enumerate(self._slots) if s.state is SlotState.FREE]
        if sorted(self._free) != free:
            raise SlotError(f"free list {sorted(self._free)} != FREE slots {free}")
        for i, s in enumerate(self._slots):
            if (s.state is SlotState.FREE) != (s.owner is None):
                raise SlotError(f"slot {i} is {s.state.value} with owner {s.owner!r}")


class SlotGuard:
    """The reader's side: the newest generation seen per (writer agent, slot).
    `admit` refuses a notice for a generation not newer than the last one
    (replayed or reordered): each generation of a slot is scattered at most once."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int], int] = {}

    def admit(self, writer: str, slot: int, generation: int) -> None:
        last = self._seen.get((writer, slot))
        if last is not None and generation <= last:
            raise StaleSlotError(f"{writer} slot {slot}: generation {generation} after {last}")
        self._seen[(writer, slot)] = generation

    def forget(self, writer: str) -> None:
        """The writer agent is gone: drop what was seen from it (bounded memory)."""
        for key in [k for k in self._seen if k[0] == writer]:
            del self._seen[key]

    def __len__(self) -> int:
        return len(self._seen)
