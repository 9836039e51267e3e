"""Staging slots (protocol/_staging.py): leased like blocks, generation-safe,
quarantined when their reader goes silent, never wedging; the reader's guard
and the bounded, typed decoding of the two notices."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    MAX_STAGE_LEN,
    STAGE_MAGIC,
    DecodeError,
    SlotError,
    SlotGuard,
    SlotRef,
    SlotState,
    StageAck,
    StageWrite,
    StagingSlots,
    StaleSlotError,
    decode_stage,
    encode_stage,
)


def test_a_slot_is_never_handed_out_twice_while_in_use() -> None:
    t = StagingSlots(2)
    a, b = t.acquire("a"), t.acquire("b")
    assert a is not None and b is not None and a.slot != b.slot
    assert t.acquire("c") is None  # no credit: the writer waits
    t.landed(a, deadline=10.0)
    assert t.acquire("c") is None  # LANDED: the reader may still be reading it
    assert t.freed(a) == "a"
    c = t.acquire("c")
    assert c == SlotRef(a.slot, a.generation + 1)  # same slot, next generation
    t.check_invariants()


def test_a_late_ack_for_an_older_generation_changes_nothing() -> None:
    t = StagingSlots(1)
    a = t.acquire("a")
    t.landed(a, 1.0)
    t.freed(a)
    b = t.acquire("b")
    with pytest.raises(StaleSlotError):
        t.freed(a)  # ABA: the ACK of the slot's previous use
    assert t.state(b.slot) == (SlotState.WRITING, b.generation)
    assert t.owner(b) == "b"


def test_an_err_frees_a_writing_slot_and_bad_refs_are_typed() -> None:
    t = StagingSlots(1)
    a = t.acquire("a")
    assert t.freed(a) == "a"  # the WRITE ended in ERR: no notice, nobody reads it
    for bad in (SlotRef(5, 0), SlotRef(-1, 0), "x"):
        with pytest.raises(SlotError):
            t.freed(bad)  # type: ignore[arg-type]
    with pytest.raises(SlotError):
        t.landed(SlotRef(0, 1), 1.0)  # FREE, not WRITING
    with pytest.raises(SlotError):
        StagingSlots(0)
    t.check_invariants()


def test_an_overdue_ack_quarantines_and_the_rest_keep_going() -> None:
    t = StagingSlots(2)
    a, b = t.acquire("a"), t.acquire("b")
    t.landed(a, 5.0)
    t.landed(b, 50.0)
    assert t.expire(4.9) == []
    assert t.expire(5.0) == [(a, "a")]
    assert t.state(a.slot)[0] is SlotState.QUARANTINED
    assert t.usable  # b comes back with its ACK
    t.freed(b)
    assert t.acquire("c") is not None  # the other slot carries on
    # A late ACK is the proof the reader is done: the quarantined slot comes back.
    t.freed(a)
    assert t.counts()["quarantined"] == 0


def test_all_quarantined_is_not_usable_until_the_peer_is_gone() -> None:
    t = StagingSlots(2)
    refs = [t.acquire(i) for i in range(2)]
    for r in refs:
        t.landed(r, 0.0)
    t.expire(1.0)
    assert not t.usable  # the writer posts directly instead of waiting forever
    w = StagingSlots(1)
    x = w.acquire("x")
    assert {o for _, o in t.reclaim_peer()} == {0, 1}
    assert t.usable and t.counts()["free"] == 2
    assert w.reclaim_peer() == []  # WRITING drains like a chunk, not reclaimed
    assert w.state(x.slot)[0] is SlotState.WRITING


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acq", "land", "ack", "err", "expire", "reclaim", "stale"]), st.integers(0, 3)), max_size=60))
def test_random_histories_keep_every_invariant(ops) -> None:
    """Against a model: a slot is in exactly one state, never acquired while
    WRITING/LANDED/QUARANTINED, its generation only grows, stale refs refused."""
    t = StagingSlots(3)
    live: dict[int, SlotRef] = {}
    gens = [0, 0, 0]
    now = 0.0
    for op, k in ops:
        now += 1.0
        if op == "acq":
            r = t.acquire(k)
            if r is not None:
                assert r.slot not in live and r.generation == gens[r.slot]
                live[r.slot] = r
            else:
                assert len(live) == 3
        elif live:
            slot = sorted(live)[k % len(live)]
            r = live[slot]
            state = t.state(slot)[0]
            if op == "land" and state is SlotState.WRITING:
                t.landed(r, now + 2)
            elif op in ("ack", "err") and (op == "ack" or state is SlotState.WRITING):
                t.freed(r)
                del live[slot]
                gens[slot] += 1
            elif op == "expire":
                t.expire(now)
            elif op == "reclaim":
                for ref, _ in t.reclaim_peer():
                    del live[ref.slot]
                    gens[ref.slot] += 1
            elif op == "stale" and r.generation > 0:
                with pytest.raises(StaleSlotError):
                    t.freed(SlotRef(slot, r.generation - 1))
        t.check_invariants()
        assert sum(t.counts().values()) == 3
        assert t.counts()["free"] == 3 - len(live)
        assert all(t.state(i)[1] == gens[i] for i in range(3))


def test_the_reader_scatters_each_generation_at_most_once() -> None:
    g = SlotGuard()
    g.admit("w.e0", 1, 0)
    with pytest.raises(StaleSlotError):
        g.admit("w.e0", 1, 0)  # a replay
    g.admit("w.e0", 1, 1)
    with pytest.raises(StaleSlotError):
        g.admit("w.e0", 1, 0)  # reordered
    g.admit("w.e1", 1, 0)  # a new writer incarnation starts over
    g.forget("w.e0")
    assert len(g) == 1


WRITE = StageWrite(
    request_id="r-1", ctx_attempt=1, gen_attempt=2, ctx_rank=1, ctx_epoch=3, chunk=4,
    start=0, end=64, max_piece=1 << 20, slot=5, generation=6, nbytes=1 << 20,
)


def test_notices_round_trip_and_bad_ones_raise_decode_error_only() -> None:
    # Engine endpoints have 63-bit epochs; attempts are 32-bit (ParentKey).
    big = msgspec.structs.replace(WRITE, ctx_epoch=2**63 - 1, ctx_attempt=2**32 - 1, generation=2**63 - 1)
    for m in (WRITE, big, StageAck(slot=5, generation=6, scattered=True)):
        assert decode_stage(encode_stage(m)) == m
    body = encode_stage(WRITE)[len(STAGE_MAGIC):]
    bad = [
        b"",
        b"KVS1",
        b"XXXX" + body,  # wrong magic
        STAGE_MAGIC + b"\xff" * 10,
        STAGE_MAGIC + msgspec.msgpack.encode(["w", "r", 0]),  # short
        STAGE_MAGIC + msgspec.msgpack.encode(["w", "r", -1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]),  # negative
        STAGE_MAGIC + msgspec.msgpack.encode(["a", 1, 2, True, "extra"]),
        STAGE_MAGIC + b"\x00" * MAX_STAGE_LEN,  # over the cap: never decoded
        "text",
        None,
    ]
    for payload in bad:
        with pytest.raises(DecodeError):
            decode_stage(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzzed_notices_raise_only_decode_error(data: bytes) -> None:
    for payload in (data, STAGE_MAGIC + data):
        with contextlib.suppress(DecodeError):  # anything else raised fails the test
            decode_stage(payload)
