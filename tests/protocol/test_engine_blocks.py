"""The protocol pieces of the engine API: exact block leases (the pool mirrors
an engine's block manager) and the ticket's string form."""

from __future__ import annotations

import base64
import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    MAX_LEND_BLOCKS,
    MAX_TICKET_CHARS,
    AdmissionRequest,
    BlockPool,
    BlockState,
    CtxRank,
    Endpoint,
    GenRank,
    HandoffTicket,
    LeaseError,
    Lend,
    ParentKey,
    PoolError,
    RankNamespace,
    Role,
    TicketError,
)

from ._helpers import end_lease


def _snapshot(pool: BlockPool) -> tuple[object, ...]:
    n = pool.num_blocks
    return (
        pool.counts(),
        tuple(pool.state_of(b) for b in range(n)),
        tuple(pool.generation_of(b) for b in range(n)),
        tuple(pool.free_order()),
    )


def test_lease_blocks_takes_exactly_the_named_blocks_in_order() -> None:
    pool = BlockPool(8)
    refs = pool.lease_blocks("a", [5, 2, 7])
    assert [r.block for r in refs] == [5, 2, 7]
    assert all(r.generation == 1 for r in refs)
    assert pool.lease_of("a") == refs
    assert [pool.state_of(b) for b in (5, 2, 7)] == [BlockState.LEASED] * 3
    # FIFO leases skip what lease_blocks took.
    assert [r.block for r in pool.lease("b", 5)] == [0, 1, 3, 4, 6]
    pool.check_invariants()
    pool.release("a")
    again = pool.lease_blocks("c", [7, 5])
    assert [(r.block, r.generation) for r in again] == [(7, 2), (5, 2)]  # a new generation
    pool.check_invariants()


@pytest.mark.parametrize(
    ("blocks", "error"),
    [
        ([], PoolError),
        ([1, 1], PoolError),
        ([8], PoolError),
        ([-1], PoolError),
        ([0, 3], PoolError),  # 3 is leased to "held"
        ([True], PoolError),
        (["1"], PoolError),
    ],
)
def test_lease_blocks_refusals_change_nothing(blocks: list[object], error: type[Exception]) -> None:
    pool = BlockPool(8)
    pool.lease_blocks("held", [3])
    before = _snapshot(pool)
    with pytest.raises(error):
        pool.lease_blocks("x", blocks)  # type: ignore[arg-type]
    assert _snapshot(pool) == before
    assert not pool.holds("x")
    pool.check_invariants()


def test_lease_blocks_refuses_a_quarantined_block_and_a_reused_owner() -> None:
    pool = BlockPool(4)
    pool.lease_blocks("q", [1, 2])
    pool.quarantine("q")
    before = _snapshot(pool)
    with pytest.raises(PoolError):
        pool.lease_blocks("x", [2])
    with pytest.raises(LeaseError):
        pool.lease_blocks("q", [0])
    assert _snapshot(pool) == before
    pool.reclaim_quarantine("q", proof="test: writer polled to DONE")
    with pytest.raises(LeaseError):  # attempts are never reused
        pool.lease_blocks("q", [0])
    assert [r.block for r in pool.lease_blocks("x", [2])] == [2]
    pool.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "exact", "release", "quarantine", "reclaim"]),
                          st.integers(0, 9), st.lists(st.integers(0, 11), max_size=4)), max_size=40))
def test_exact_and_fifo_leases_keep_the_pool_invariants(ops: list[tuple[str, int, list[int]]]) -> None:
    pool = BlockPool(10)
    owners: list[str] = []
    for i, (op, k, blocks) in enumerate(ops):
        owner = f"o{i}"
        try:
            if op == "lease":
                pool.lease(owner, k + 1)
                owners.append(owner)
            elif op == "exact":
                pool.lease_blocks(owner, blocks)
                owners.append(owner)
            elif owners:
                end_lease(pool, op, owners[k % len(owners)])
        except (PoolError, LeaseError):
            pass
        pool.check_invariants()
        held = [pool.lease_of(o) for o in owners if pool.holds(o)]
        blocks_held = [r.block for refs in held for r in refs]
        assert len(blocks_held) == len(set(blocks_held))  # S4: no block in two leases


def _ep(role: Role) -> Endpoint:
    return Endpoint(ns=RankNamespace(instance_id="i", role=role, rank=0), epoch=1)


@pytest.mark.parametrize("side", ["ctx", "gen"])
def test_rank_admit_with_block_ids(side: str) -> None:
    pool = BlockPool(8)
    parent = ParentKey(request_id="r", ctx_attempt=1, gen_attempt=1)
    if side == "ctx":
        rank: CtxRank | GenRank = CtxRank(_ep(Role.CTX), b"d" * 32, pool, transfer_timeout=1.0, edges_per_parent=1)

        def admit(p: ParentKey, n: int, blocks: list[int]) -> object:
            return rank.admit(p, n, now=0.0, lease_deadline=5.0, blocks=blocks)  # type: ignore[union-attr]
    else:
        rank = GenRank(_ep(Role.GEN), b"d" * 32, pool, transfer_timeout=1.0)

        def admit(p: ParentKey, n: int, blocks: list[int]) -> object:
            return rank.admit(p, n, now=0.0, deadline=5.0, blocks=blocks)

    before = _snapshot(pool)
    with pytest.raises(LeaseError):
        admit(parent, 3, [1, 2])  # fewer ids than blocks
    assert _snapshot(pool) == before and parent not in rank.parents()
    refs = admit(parent, 2, [6, 4])
    assert [r.block for r in refs] == [6, 4]  # type: ignore[attr-defined]
    assert parent in rank.parents()


def test_admission_request_bounds_its_block_ids() -> None:
    base = {"parent": {"request_id": "r", "ctx_attempt": 0, "gen_attempt": 0}, "num_tokens": 3}
    ok = msgspec.convert({**base, "blocks": [0, 7, 2**32 - 1]}, AdmissionRequest)
    assert ok.blocks == (0, 7, 2**32 - 1)
    for bad in ([-1], [2**32], ["1"], [1.5]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**base, "blocks": bad}, AdmissionRequest)
    # Old senders (no blocks field) still decode: each rank leases free blocks.
    assert msgspec.convert(base, AdmissionRequest).blocks == ()


_ids = st.from_regex(r"[A-Za-z0-9_.:\-]{1,40}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(_ids, _ids, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.binary(min_size=32, max_size=32),
       st.integers(0, 2**32 - 1))
def test_ticket_string_round_trips(dep: str, rid: str, ca: int, ga: int, digest: bytes, tokens: int) -> None:
    ticket = HandoffTicket(
        deployment=dep, request_id=rid, ctx_attempt=ca, gen_attempt=ga, ctx_instance=dep + "-ctx",
        ctx_digest=digest, num_tokens=tokens,
    )
    text = ticket.encode()
    assert text.isascii() and len(text) <= MAX_TICKET_CHARS
    assert all(c.isalnum() or c in "-_." for c in text)  # safe in a URL, a header, JSON
    assert HandoffTicket.decode(text) == ticket
    assert ticket.parent == ParentKey(request_id=rid, ctx_attempt=ca, gen_attempt=ga)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(
    lambda b: "kvh1." + base64.urlsafe_b64encode(b).decode().rstrip("="))))
def test_ticket_decode_raises_only_ticket_error(text: str) -> None:
    with contextlib.suppress(TicketError):
        HandoffTicket.decode(text)


def test_ticket_decode_checks_the_length_first() -> None:
    huge = "kvh1." + "A" * (10 * 1024 * 1024)
    with pytest.raises(TicketError, match="characters"):
        HandoffTicket.decode(huge)
    good = HandoffTicket(
        deployment="d", request_id="r", ctx_attempt=1, gen_attempt=1, ctx_instance="d-ctx",
        ctx_digest=b"x" * 32, num_tokens=5,
    )
    wrong_field = msgspec.msgpack.encode({**msgspec.structs.asdict(good), "num_tokens": -1})
    with pytest.raises(TicketError):
        HandoffTicket.decode("kvh1." + base64.urlsafe_b64encode(wrong_field).decode())
    extra = msgspec.msgpack.encode({**msgspec.structs.asdict(good), "admin": True})
    with pytest.raises(TicketError):
        HandoffTicket.decode("kvh1." + base64.urlsafe_b64encode(extra).decode())


_PARENT = ParentKey(request_id="r", ctx_attempt=1, gen_attempt=0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=MAX_LEND_BLOCKS), st.integers(1, 2**63 - 1))
def test_a_lent_ticket_round_trips_with_its_blocks_and_seal(ids: list[int], seq: int) -> None:
    """A pull ticket carries its lend (block ids, incarnations, number,
    seal) through the string form, within `MAX_TICKET_CHARS` for the most
    blocks a lend names; the seal verifies with the lender's key only."""
    key = b"k" * 16
    lend = Lend.seal(key, _PARENT, ctx_epoch=7, gen_epoch=9, seq=seq, blocks=Lend.pack(ids))
    ticket = HandoffTicket(
        deployment="d", request_id="r", ctx_attempt=1, gen_attempt=0, ctx_instance="d-ctx",
        ctx_digest=b"x" * 32, num_tokens=5, lend=lend,
    )
    text = ticket.encode()
    assert len(text) <= MAX_TICKET_CHARS
    back = HandoffTicket.decode(text)
    assert back == ticket and back.lend is not None and back.lend.block_ids() == ids
    assert back.lend.verify(key, _PARENT)
    assert not back.lend.verify(b"j" * 16, _PARENT)


def test_a_lend_seal_binds_every_field_and_the_parent() -> None:
    """Changing any field of a sealed lend (its blocks, number, either
    incarnation) or reading it for another parent breaks the seal: a proxy
    cannot point a reader at another request's blocks. No key, no seal."""
    key = b"k" * 16
    lend = Lend.seal(key, _PARENT, ctx_epoch=7, gen_epoch=9, seq=3, blocks=Lend.pack([4, 5, 6]))
    assert lend.verify(key, _PARENT)
    for changed in (
        msgspec.structs.replace(lend, blocks=Lend.pack([4, 5, 7])),
        msgspec.structs.replace(lend, seq=4),
        msgspec.structs.replace(lend, ctx_epoch=8),
        msgspec.structs.replace(lend, gen_epoch=10),
    ):
        assert not changed.verify(key, _PARENT)
    for other in (
        ParentKey(request_id="r2", ctx_attempt=1, gen_attempt=0),
        ParentKey(request_id="r", ctx_attempt=2, gen_attempt=0),
        ParentKey(request_id="r", ctx_attempt=1, gen_attempt=1),
    ):
        assert not lend.verify(key, other)
    assert not lend.verify(b"", _PARENT)


def test_a_lend_beyond_its_bounds_is_a_ticket_error() -> None:
    """A lend of more blocks than `MAX_LEND_BLOCKS`, of a partial block id,
    of lend number 0, or with a short seal does not decode (`TicketError`)."""
    good = HandoffTicket(
        deployment="d", request_id="r", ctx_attempt=1, gen_attempt=0, ctx_instance="d-ctx",
        ctx_digest=b"x" * 32, num_tokens=5,
        lend=Lend.seal(b"k" * 16, _PARENT, ctx_epoch=7, gen_epoch=9, seq=3, blocks=Lend.pack([1])),
    )
    raw = msgspec.structs.asdict(good)
    lend = msgspec.structs.asdict(good.lend)
    for bad in (
        {"blocks": b"\0" * (4 * MAX_LEND_BLOCKS + 4)},
        {"seq": 0},
        {"mac": b"m" * 8},
        {"blocks": b""},
    ):
        wire = msgspec.msgpack.encode({**raw, "lend": {**lend, **bad}})
        with pytest.raises(TicketError):
            HandoffTicket.decode("kvh1." + base64.urlsafe_b64encode(wire).decode().rstrip("="))
    odd = msgspec.structs.replace(good.lend, blocks=b"\1\2\3\4\5")
    with pytest.raises(TicketError, match="uint32"):
        odd.block_ids()
