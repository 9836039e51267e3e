"""Decisions the CTX rank makes itself: when a parent is prepared, whether an
OPEN's buffer may be written, and the local outcome each ending reports.

* `Prepared(parent)` comes exactly once, with the last expected edge's OPEN,
  never before it, never after a cancel, and an OPEN past the parent's edges is
  refused.
* Each buffer check of `receive_open` (block count against the lease, block
  length, the sender's own agent, whole blocks of its registered buffer)
  refuses with its typed error, answers a typed REJECT, and changes nothing;
  the same OPEN passes once the one fault is gone.
* `Release`, `Quarantine` and `DecodeReady` carry the `LocalOutcome` of the
  event that ended the parent; `LocalOutcome` is a plain string to callers.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import msgspec
import pytest

from kvhandoff.protocol import (
    BlockDescriptor,
    CancelReason,
    CtxRank,
    DecodeReady,
    EdgeState,
    IllegalTransition,
    LeaseError,
    LocalOutcome,
    Open,
    ParentState,
    PeerBuffer,
    Prepared,
    ProtocolError,
    Quarantine,
    Reject,
    RejectReason,
    Release,
    StaleError,
    block_columns,
    pack_blocks,
    reject_for,
)

from ._helpers import decided, prepared, resident, take_opens
from .harness import CHUNK_BYTES, Pair, buffer_for, gen_endpoint, make_ticket, parent_key

P = parent_key(1)
AGENT = "gen-agent-1"  # harness.buffer_for: agent of GEN epoch 1, block b at b * CHUNK_BYTES
PEER = PeerBuffer(agent_name=AGENT, base=0, block_bytes=CHUNK_BYTES, num_blocks=16)
CHECKS: dict[str, Any] = {"expected_agent": AGENT, "block_bytes": CHUNK_BYTES, "peer": PEER}


def _resident(n_gen: int = 1, blocks: int = 2) -> tuple[Pair, list[Open]]:
    pair = resident(Pair(n_gen=n_gen), blocks=blocks)
    return pair, take_opens(pair)


def _prepared(actions: list[Any]) -> list[Prepared]:
    return [a for a in actions if isinstance(a, Prepared)]


# ---- Prepared ---------------------------------------------------------------------


def test_prepared_once_with_the_last_expected_edge() -> None:
    pair, opens = _resident(n_gen=3)
    assert pair.ctx.edges_per_parent == 3
    for open_msg in opens[:-1]:
        assert _prepared(pair.ctx.receive_open(open_msg, pair.now)) == []
        assert not pair.ctx.is_prepared(P)
    assert _prepared(pair.ctx.receive_open(opens[-1], pair.now)) == [Prepared(P)]
    assert pair.ctx.is_prepared(P)
    # Decided: no longer "prepared" (a proposal), and nothing reports it again.
    actions = pair.ctx.decided(P, pair.now)
    assert _prepared(actions) == [] and not pair.ctx.is_prepared(P)


def test_an_open_past_the_parents_edges_is_refused_and_changes_nothing() -> None:
    pair, opens = _resident(n_gen=2)
    for open_msg in opens:
        pair.ctx.receive_open(open_msg, pair.now)
    assert pair.ctx.is_prepared(P)
    extra = Open(
        ticket=make_ticket(P, pair.ctx.our, gen_endpoint(rank=7)),
        buffer=buffer_for(pair.gens[0].lease(P), 1),
        num_tokens=16,
    )
    before = pair.ctx.snapshot()
    with pytest.raises(LeaseError):
        pair.ctx.receive_open(extra, pair.now)
    assert pair.ctx.snapshot() == before
    assert pair.ctx.is_prepared(P)


def test_never_prepared_after_a_cancel() -> None:
    pair, opens = _resident(n_gen=2)
    assert _prepared(pair.ctx.receive_open(opens[0], pair.now)) == []
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    before = pair.ctx.snapshot()
    with pytest.raises(IllegalTransition):
        pair.ctx.receive_open(opens[1], pair.now)
    assert pair.ctx.snapshot() == before
    assert not pair.ctx.is_prepared(P)
    assert not [a for a in pair.actions if isinstance(a, Prepared)]


def test_is_prepared_turns_false_when_a_prepared_parent_is_cancelled() -> None:
    """What an actor that performs `Prepared` after an await checks first."""
    pair, opens = _resident(n_gen=1)
    assert _prepared(pair.ctx.receive_open(opens[0], pair.now)) == [Prepared(P)]
    pair.perform(pair.ctx.cancel(P, CancelReason.PEER, pair.now), pair.ctx)
    assert not pair.ctx.is_prepared(P)
    assert not pair.ctx.is_prepared(parent_key(99))


def test_edges_per_parent_must_be_positive() -> None:
    pair = Pair()
    with pytest.raises(LeaseError):
        CtxRank(pair.ctx.our, pair.ctx.digest, pair.ctx.pool, edges_per_parent=0)


# ---- OPEN buffer checks -----------------------------------------------------------


def _blocks(message: Open, **change: Any) -> Open:
    r = msgspec.structs.replace
    return r(message, buffer=r(message.buffer, **change))


def _descriptor(d: BlockDescriptor, **change: Any) -> BlockDescriptor:
    return msgspec.structs.replace(d, **change)


def _bad_opens(good: Open) -> list[tuple[str, Open, dict[str, Any], type[ProtocolError]]]:
    b = good.buffer.blocks
    return [
        ("fewer blocks than the lease", _blocks(good, blocks=b[:1]), {}, LeaseError),
        (
            "more blocks than the lease",
            _blocks(good, blocks=[*b, BlockDescriptor(5, 1, 5 * CHUNK_BYTES, CHUNK_BYTES)]),
            {},
            LeaseError,
        ),
        (
            "a block length other than the GEN block size",
            _blocks(good, blocks=[_descriptor(d, length=CHUNK_BYTES // 2) for d in b]),
            {"block_bytes": CHUNK_BYTES, "peer": None},
            LeaseError,
        ),
        # The GEN's registered buffer is not known yet (it restarted): the agent
        # check alone refuses.
        ("another agent", _blocks(good, agent_name="gen-agent-9"), {"peer": None}, StaleError),
        (
            "a descriptor not at its block's address",
            _blocks(good, blocks=[b[0], _descriptor(b[1], addr=b[1].addr + 64)]),
            {},
            LeaseError,
        ),
        (
            "a block past the registered pool",
            _blocks(good, blocks=[b[0], _descriptor(b[1], block=16, addr=16 * CHUNK_BYTES)]),
            {},
            LeaseError,
        ),
        (
            "the registered buffer of another agent",
            good,
            {"peer": PeerBuffer("gen-agent-2", 0, CHUNK_BYTES, 16)},
            StaleError,
        ),
        (
            # GEN-block-sized descriptors at the block addresses of a buffer
            # registered with twice that block size: not whole blocks of it.
            "a registered buffer of another block size",
            _blocks(good, blocks=[_descriptor(d, addr=d.block * 2 * CHUNK_BYTES) for d in b]),
            {"peer": PeerBuffer(AGENT, 0, 2 * CHUNK_BYTES, 16)},
            LeaseError,
        ),
        (
            # A GEN with its KV in several regions: region 0's blocks are
            # 3 * CHUNK_BYTES apart; descriptors one logical block apart are not its blocks.
            "a registered region of another block stride",
            good,
            {"peer": PeerBuffer(AGENT, 0, CHUNK_BYTES, 16, block_stride=3 * CHUNK_BYTES)},
            LeaseError,
        ),
    ]


def test_an_open_at_the_block_stride_of_region_0_is_accepted() -> None:
    """Blocks at `base + block * block_stride` with the logical block length are
    whole blocks of a GEN whose region 0 has that stride."""
    pair, (good,) = _resident()
    stride = 3 * CHUNK_BYTES
    moved = _blocks(good, blocks=[_descriptor(d, addr=0x1000 + d.block * stride) for d in good.buffer.blocks])
    peer = PeerBuffer(AGENT, 0x1000, CHUNK_BYTES, 16, block_stride=stride)
    actions = pair.ctx.receive_open(moved, pair.now, **{**CHECKS, "peer": peer})
    assert _prepared(actions)


def _packed(message: Open) -> Open:
    """The same OPEN with its block list in the packed form."""
    c = block_columns(message.buffer)
    return _blocks(message, blocks=pack_blocks(c.blocks, c.lengths, c.generations, c.addrs))


def _cases() -> list[Any]:
    _pair, (good,) = _resident()
    return [
        pytest.param(form(bad), {**CHECKS, **checks}, error, id=f"{name} ({form.__name__.strip('_')})")
        for name, bad, checks, error in _bad_opens(good)
        for form in (_listed, _packed)
    ]


def _listed(message: Open) -> Open:
    return message


@pytest.mark.parametrize(("bad", "checks", "error"), _cases())
def test_each_open_check_refuses_typed_and_changes_nothing(
    bad: Open, checks: dict[str, Any], error: type[ProtocolError]
) -> None:
    pair, (good,) = _resident()
    before = [r.snapshot() for r in pair.ranks()]
    with pytest.raises(error) as refused:
        pair.ctx.receive_open(bad, pair.now, **checks)
    assert type(refused.value) is error
    assert [r.snapshot() for r in pair.ranks()] == before
    assert pair.ctx.edges(P) == {} and not pair.ctx.is_prepared(P)
    # The refusal is answered: a typed REJECT with the OPEN's own ticket.
    reject = reject_for(bad, refused.value, pair.ctx.our)
    assert isinstance(reject, Reject)
    assert reject.ticket == bad.ticket and reject.reason is RejectReason.STALE
    # The same session with the good buffer (in the refused one's form) and the
    # actor's expectations passes.
    good = _packed(good) if isinstance(bad.buffer.blocks, bytes) else good
    assert _prepared(pair.ctx.receive_open(good, pair.now, **CHECKS)) == [Prepared(P)]
    assert pair.ctx.evidence(good.ticket).state is EdgeState.PREPARED


def test_a_refused_open_ends_the_gen_side_as_not_started() -> None:
    """Through the frames: the REJECT a buffer check causes is NOT_STARTED on GEN."""
    pair, (good,) = _resident()
    bad = _blocks(good, agent_name="gen-agent-9")
    with pytest.raises(StaleError) as refused:
        pair.ctx.receive_open(bad, pair.now, **CHECKS)
    reject = reject_for(bad, refused.value, pair.ctx.our)
    assert reject is not None
    pair.perform(pair.gens[0].receive(reject, pair.now), pair.gens[0])
    assert pair.gens[0].evidence(good.ticket).state is EdgeState.NOT_STARTED


# ---- local outcomes ---------------------------------------------------------------


def _one(actions: list[Any], kind: type) -> Any:
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, actions
    return found[0]


def test_success_outcomes() -> None:
    pair = decided(Pair(chunk_window=1))
    pair.pump()
    ctx_release = _one(pair.ctx.completed(P), Release)
    assert ctx_release.outcome is LocalOutcome.RELEASED
    assert _one(pair.gens[0].completed(P, pair.now), DecodeReady).outcome is LocalOutcome.COMPLETED
    assert _one(pair.gens[0].free(P), Release).outcome is LocalOutcome.COMPLETED


def test_consumer_deadline_outcome_is_completed() -> None:
    pair = decided(Pair(chunk_window=1), chunks=1)
    pair.pump()
    gen = pair.gens[0]
    gen.completed(P, pair.now)
    release = _one(gen.expire(pair.now + gen.consume_timeout + 1), Release)
    assert release.outcome is LocalOutcome.COMPLETED


def test_withdrawn_admission_is_rejected() -> None:
    pair = Pair()
    pair.admit(P)
    assert _one(pair.ctx.withdraw(P), Release).outcome is LocalOutcome.REJECTED
    assert _one(pair.gens[0].withdraw(P), Release).outcome is LocalOutcome.REJECTED


def test_cancelled_outcomes() -> None:
    # A decided cancel of a settled, cancelled parent, and the NOT_STARTED verdict.
    pair = prepared(Pair())
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)
    pair.deliver_all()
    assert pair.ctx.parent_state(P) is ParentState.SETTLED
    ctx_release = _one(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now, from_round=True), Release)
    assert ctx_release.outcome is LocalOutcome.CANCELLED
    gen = pair.gens[0]
    assert gen.local_not_started(P)
    assert _one(gen.release_not_started(P), Release).outcome is LocalOutcome.CANCELLED


def test_quarantine_and_reclaim_outcomes() -> None:
    pair = decided(Pair(chunk_window=1), chunks=3)
    pair.perform(pair.ctx.cancel(P, CancelReason.CLIENT, pair.now), pair.ctx)  # draining
    actions = pair.ctx.expire(pair.now + pair.timeout + 1)  # the drain never ends
    assert _one(actions, Quarantine).outcome is LocalOutcome.QUARANTINED
    release = _one(pair.ctx.reclaim(P, proof="writer's agent torn down"), Release)
    assert release.reclaimed and release.outcome is LocalOutcome.QUARANTINED


def test_local_outcome_is_a_plain_string_to_callers() -> None:
    for outcome in LocalOutcome:
        assert outcome == outcome.value and isinstance(outcome, str)
        assert hash(outcome) == hash(outcome.value)
        assert str(outcome) == f"{outcome}" == outcome.value
        assert pickle.loads(pickle.dumps(outcome)) is outcome  # a Ray hop
        assert json.dumps(outcome) == json.dumps(outcome.value)
        assert msgspec.json.encode(outcome) == msgspec.json.encode(outcome.value)
    assert {"failed", "timeout"} & {LocalOutcome.FAILED} == {"failed"}
    assert {o.value for o in LocalOutcome} == {
        "completed",
        "cancelled",
        "rejected",
        "failed",
        "released",
        "quarantined",
    }

