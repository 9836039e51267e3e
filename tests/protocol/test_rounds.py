"""Agreement rounds, sans-IO: leader decisions, vote validation, follower order.

Every test drives `RoundLeader` / `RoundFollower` with an injected clock
(plain floats): no sleeps, no I/O.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    AdmissionRequest,
    ParentKey,
    ProtocolError,
    RoundDecision,
    RoundError,
    RoundFollower,
    RoundLeader,
    RoundOrderError,
    RoundPhaseError,
    RoundProposal,
    RoundTimedOut,
    RoundVote,
    StaleError,
    VoteRejected,
    VoteRejectReason,
)

T = 1.0  # round timeout used throughout


def pk(name: str, attempt: int = 0) -> ParentKey:
    return ParentKey(request_id=name, ctx_attempt=attempt, gen_attempt=0)


def adm(name: str, tokens: int = 16) -> AdmissionRequest:
    return AdmissionRequest(parent=pk(name), num_tokens=tokens)


def vote(
    leader_round: int,
    rank: int,
    *,
    epoch: int = 0,
    ok: tuple[str, ...] = (),
    cancels: tuple[str, ...] = (),
    completions: tuple[str, ...] = (),
    failures: tuple[str, ...] = (),
) -> RoundVote:
    return RoundVote(
        round_no=leader_round,
        rank=rank,
        epoch=epoch,
        admit_ok=tuple(pk(n) for n in ok),
        cancels=tuple(pk(n) for n in cancels),
        completions=tuple(pk(n) for n in completions),
        failures=tuple(pk(n) for n in failures),
    )


def names(parents: tuple[ParentKey, ...]) -> list[str]:
    return [p.request_id for p in parents]


def admit_all(leader: RoundLeader, *requests: str, now: float = 0.0) -> RoundDecision:
    """Run one round in which every rank admits ``requests``."""
    proposal = leader.open_round([adm(n) for n in requests], now=now, timeout=T)
    for rank in leader.ranks:
        leader.receive_vote(
            vote(proposal.round_no, rank, epoch=leader.epoch_of(rank), ok=requests), now
        )
    return leader.close(now)


# -- ordering and numbering ---------------------------------------------------


def test_rounds_are_numbered_in_order_and_one_at_a_time() -> None:
    leader = RoundLeader(2)
    first = leader.open_round(now=0.0, timeout=T)
    assert first.round_no == 1
    with pytest.raises(RoundPhaseError):
        leader.open_round(now=0.0, timeout=T)  # only one open round
    assert leader.proposal == first  # the refused call changed nothing
    leader.receive_vote(vote(1, 0), 0.1)
    assert leader.receive_vote(vote(1, 1), 0.2) is True
    empty = leader.close(0.3)
    assert empty == RoundDecision(round_no=1)  # unconditional round, no news
    assert leader.open_round(now=1.0, timeout=T).round_no == 2


def test_close_needs_every_vote_and_changes_nothing_otherwise() -> None:
    leader = RoundLeader(3)
    leader.open_round([adm("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a",)), 0.0)
    with pytest.raises(RoundError):
        leader.close(0.0)
    assert leader.missing() == (1, 2)
    leader.receive_vote(vote(1, 1, ok=("a",)), 0.0)
    leader.receive_vote(vote(1, 2, ok=("a",)), 0.0)
    assert names(leader.close(0.0).admitted) == ["a"]


def test_idle_leader_refuses_close_and_expire() -> None:
    leader = RoundLeader(1)
    with pytest.raises(RoundPhaseError):
        leader.close(0.0)
    with pytest.raises(RoundPhaseError):
        leader.expire(10.0)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 0), 0.0)
    assert info.value.reason is VoteRejectReason.NO_ROUND_OPEN


def test_bad_round_input_is_a_typed_error_and_changes_nothing() -> None:
    leader = RoundLeader(2)
    with pytest.raises(RoundError):
        leader.open_round([adm("a"), adm("a")], now=0.0, timeout=T)  # twice
    with pytest.raises(RoundError):
        leader.open_round(now=0.0, timeout=0.0)
    assert leader.proposal is None and leader.next_round == 1
    admit_all(leader, "a")
    with pytest.raises(RoundError):
        leader.open_round([adm("a")], now=0.0, timeout=T)  # already in flight
    assert leader.next_round == 2
    for bad in (0, [], [1, 1], [4096]):
        with pytest.raises(RoundError):
            RoundLeader(bad)


# -- decision semantics ---------------------------------------------------------


def test_admission_needs_every_rank() -> None:
    leader = RoundLeader(4)
    proposal = leader.open_round([adm("a"), adm("b"), adm("c")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a", "b", "c")), 0.0)
    leader.receive_vote(vote(1, 1, ok=("a", "c")), 0.0)  # out of blocks for b
    leader.receive_vote(vote(1, 2, ok=("a", "b", "c")), 0.0)
    leader.receive_vote(vote(1, 3, ok=("a", "b")), 0.0)  # out of blocks for c
    decision = leader.close(0.0)
    assert decision.round_no == proposal.round_no
    assert names(decision.admitted) == ["a"]
    assert names(decision.rejected) == ["b", "c"]
    assert leader.in_flight == {pk("a")}


def test_cancels_are_a_union_and_completions_an_intersection() -> None:
    leader = RoundLeader(3)
    admit_all(leader, "a", "b", "c", "d")
    leader.open_round(cancels=[pk("d")], now=0.0, timeout=T)  # client cancel
    leader.receive_vote(vote(2, 0, cancels=("a",), completions=("b", "c")), 0.0)
    leader.receive_vote(vote(2, 1, completions=("b", "c")), 0.0)
    leader.receive_vote(vote(2, 2, completions=("b",)), 0.0)  # c not done here
    decision = leader.close(0.0)
    assert names(decision.cancelled) == ["a", "d"]
    assert names(decision.completed) == ["b"]
    assert leader.in_flight == {pk("c")}  # c still needs rank 2


def test_failures_are_a_union_and_win_over_everything() -> None:
    leader = RoundLeader(2)
    admit_all(leader, "a", "b")
    leader.open_round([adm("n")], cancels=[pk("b")], failures=[pk("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(2, 0, ok=("n",), completions=("a", "b"), failures=("n",)), 0.0)
    leader.receive_vote(vote(2, 1, ok=("n",), completions=("a", "b")), 0.0)
    decision = leader.close(0.0)
    assert names(decision.failed) == ["a", "n"]  # injected + reported by one rank
    assert names(decision.cancelled) == ["b"]  # cancel beats completion
    assert decision.admitted == () and decision.completed == () and decision.rejected == ()
    assert leader.in_flight == set()


def test_cancel_wins_over_admission_in_the_same_round() -> None:
    leader = RoundLeader(2)
    leader.open_round([adm("a"), adm("b")], cancels=[pk("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a", "b"), cancels=("b",)), 0.0)
    leader.receive_vote(vote(1, 1, ok=("a", "b")), 0.0)
    decision = leader.close(0.0)
    assert decision.admitted == ()
    assert names(decision.cancelled) == ["a", "b"]
    assert decision.rejected == ()  # one outcome per parent
    assert leader.in_flight == set()


def test_news_about_unknown_parents_is_dropped() -> None:
    leader = RoundLeader(1)
    leader.open_round(cancels=[pk("ghost")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, completions=("x",), failures=("y",)), 0.0)
    assert leader.close(0.0) == RoundDecision(round_no=1)


# -- vote validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_vote", "reason"),
    [
        (vote(2, 0), VoteRejectReason.UNKNOWN_ROUND),
        (vote(1, 7), VoteRejectReason.UNKNOWN_RANK),
        (vote(1, 0, epoch=4), VoteRejectReason.STALE_EPOCH),
        (vote(1, 0, epoch=9), VoteRejectReason.UNKNOWN_EPOCH),
        (vote(1, 0, epoch=5, ok=("zz",)), VoteRejectReason.NOT_PROPOSED),
    ],
)
def test_invalid_votes_are_rejected_with_a_reason(
    bad_vote: RoundVote, reason: VoteRejectReason
) -> None:
    leader = RoundLeader(2, epochs={0: 5, 1: 5})
    leader.open_round([adm("a")], now=0.0, timeout=T)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(bad_vote, 0.1)
    assert info.value.reason is reason
    assert isinstance(info.value, ProtocolError)
    assert leader.missing() == (0, 1)  # nothing recorded


def test_duplicate_vote_is_rejected_and_the_first_one_stands() -> None:
    leader = RoundLeader(2)
    leader.open_round([adm("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a",)), 0.0)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 0), 0.0)  # would veto a
    assert info.value.reason is VoteRejectReason.DUPLICATE
    leader.receive_vote(vote(1, 1, ok=("a",)), 0.0)
    assert names(leader.close(0.0).admitted) == ["a"]


def test_vote_for_a_closed_round_is_stale() -> None:
    leader = RoundLeader(1)
    admit_all(leader)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 0), 0.0)
    assert info.value.reason is VoteRejectReason.STALE_ROUND
    leader.open_round(now=0.0, timeout=T)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 0), 0.0)
    assert info.value.reason is VoteRejectReason.STALE_ROUND


def test_restarted_rank_epoch_rejects_the_old_incarnation() -> None:
    leader = RoundLeader(2, epochs={0: 1, 1: 2})
    leader.set_epoch(1, 3)
    with pytest.raises(StaleError):
        leader.set_epoch(1, 3)  # epochs only increase
    leader.open_round(now=0.0, timeout=T)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 1, epoch=2), 0.0)
    assert info.value.reason is VoteRejectReason.STALE_EPOCH
    leader.receive_vote(vote(1, 1, epoch=3), 0.0)
    assert leader.missing() == (0,)


# -- deadlines ---------------------------------------------------------------------


def test_a_rank_that_never_answers_times_the_round_out() -> None:
    leader = RoundLeader(3)
    admit_all(leader, "old")  # in flight: has a shard on every rank
    leader.open_round([adm("a")], cancels=[pk("c")], now=10.0, timeout=T)
    leader.receive_vote(vote(2, 0, ok=("a",), cancels=("old",)), 10.2)
    leader.receive_vote(vote(2, 2, ok=("a",)), 10.3)
    assert leader.expire(10.9) is None  # before the deadline: nothing happens
    assert leader.proposal is not None
    outcome = leader.expire(11.0)
    assert isinstance(outcome, RoundTimedOut)
    assert outcome.round_no == 2 and outcome.missing_ranks == (1,)
    decision = outcome.decision
    assert decision.round_no == 2 and decision.timed_out
    assert decision.admitted == () and names(decision.rejected) == ["a"]
    assert names(decision.failed) == ["old"]  # failure beats the cancel intent
    assert leader.in_flight == set() and leader.proposal is None
    assert leader.open_round(now=12.0, timeout=T).round_no == 3  # no gap, no reuse


def test_a_vote_after_the_deadline_is_ignored_not_applied() -> None:
    leader = RoundLeader(2)
    leader.open_round([adm("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a",)), 0.5)
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 1, ok=("a",)), 1.0)  # at the deadline: late
    assert info.value.reason is VoteRejectReason.LATE
    with pytest.raises(RoundError):
        leader.close(1.0)  # the late vote did not count
    outcome = leader.expire(1.0)
    assert outcome is not None and outcome.missing_ranks == (1,)
    assert outcome.decision.admitted == () and names(outcome.decision.rejected) == ["a"]
    with pytest.raises(VoteRejected) as info:
        leader.receive_vote(vote(1, 1, ok=("a",)), 1.5)  # and after the round: stale
    assert info.value.reason is VoteRejectReason.STALE_ROUND


def test_abort_names_the_dead_rank_and_distrusts_its_vote() -> None:
    leader = RoundLeader(2)
    leader.open_round([adm("a")], now=0.0, timeout=T)
    leader.receive_vote(vote(1, 0, ok=("a",)), 0.0)
    leader.receive_vote(vote(1, 1, ok=("a",)), 0.0)
    outcome = leader.abort([1], 0.1)
    assert outcome.missing_ranks == (1,) and outcome.decision.admitted == ()


# -- follower ------------------------------------------------------------------------


def test_follower_applies_strictly_in_order_exactly_once() -> None:
    follower = RoundFollower(rank=0, epoch=7)
    follower.apply(RoundDecision(round_no=1))
    follower.apply(RoundDecision(round_no=2))
    for round_no, kind in ((1, "stale"), (2, "duplicate"), (4, "out_of_order")):
        with pytest.raises(RoundOrderError) as info:
            follower.apply(RoundDecision(round_no=round_no))
        assert info.value.kind == kind and info.value.expected == 3
        assert follower.last_applied == 2  # unchanged
    follower.apply(RoundDecision(round_no=3))
    assert follower.last_applied == 3


def test_follower_votes_once_on_the_next_round_only() -> None:
    follower = RoundFollower(rank=1, epoch=3)
    with pytest.raises(RoundOrderError):
        follower.vote(RoundProposal(round_no=2))
    built = follower.vote(RoundProposal(round_no=1, admissions=(adm("a"),)), admit_ok=[pk("a")])
    assert (built.rank, built.epoch, built.round_no) == (1, 3, 1)
    with pytest.raises(RoundOrderError):
        follower.vote(RoundProposal(round_no=1))  # twice: would double-lease
    with pytest.raises(RoundError):
        RoundFollower(rank=1, epoch=3).vote(RoundProposal(round_no=1), admit_ok=[pk("x")])
    follower.apply(RoundDecision(round_no=1))
    follower.vote(RoundProposal(round_no=2))


def test_follower_that_missed_a_proposal_still_applies_and_the_late_proposal_is_stale() -> None:
    follower = RoundFollower(rank=0, epoch=0)
    follower.apply(RoundDecision(round_no=1, timed_out=True))
    with pytest.raises(RoundOrderError):
        follower.check_proposal(RoundProposal(round_no=1))


def test_follower_checks_the_topology_digest() -> None:
    digest = bytes(32)
    follower = RoundFollower(rank=0, epoch=0, topology_digest=digest)
    with pytest.raises(StaleError):
        follower.apply(RoundDecision(round_no=1, topology_digest=b"\x01" * 32))
    follower.apply(RoundDecision(round_no=1, topology_digest=digest))


def test_restarted_follower_joins_at_the_leaders_next_round() -> None:
    follower = RoundFollower(rank=0, epoch=9, first_round=5)
    with pytest.raises(RoundOrderError):
        follower.apply(RoundDecision(round_no=4))
    follower.apply(RoundDecision(round_no=5))


def test_round_messages_round_trip_through_msgpack() -> None:
    decision = RoundDecision(round_no=3, admitted=(pk("a"),), failed=(pk("b"),))
    outcome = RoundTimedOut(round_no=3, missing_ranks=(1,), decision=decision)
    for message in (decision, outcome, vote(1, 0, ok=("a",)), RoundProposal(round_no=1)):
        raw = msgspec.msgpack.encode(message)
        assert msgspec.msgpack.decode(raw, type=type(message)) == message
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"type": "round_vote", "round_no": 0, "rank": 0, "epoch": 0}),
            type=RoundVote,
        )


# -- determinism (property) ------------------------------------------------------------

NAMES = [f"r{i}" for i in range(6)]
subsets = st.lists(st.sampled_from(NAMES), unique=True, max_size=6).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(min_value=1, max_value=4),
    in_flight=subsets,
    proposed=subsets,
    client_cancels=subsets,
    news=st.lists(st.tuples(subsets, subsets, subsets, subsets), min_size=4, max_size=4),
    order_seed=st.randoms(use_true_random=False),
)
def test_decision_is_invariant_under_vote_arrival_order(
    ranks: int,
    in_flight: tuple[str, ...],
    proposed: tuple[str, ...],
    client_cancels: tuple[str, ...],
    news: list[tuple[tuple[str, ...], ...]],
    order_seed: object,
) -> None:
    proposed = tuple(n for n in proposed if n not in in_flight)

    def run(order: list[int]) -> RoundDecision:
        leader = RoundLeader(ranks)
        admit_all(leader, *in_flight)
        leader.open_round(
            [adm(n) for n in proposed], [pk(n) for n in client_cancels], now=0.0, timeout=T
        )
        for rank in order:
            ok, cancels, completions, failures = news[rank]
            leader.receive_vote(
                vote(
                    2,
                    rank,
                    ok=tuple(n for n in ok if n in proposed),
                    cancels=cancels,
                    completions=completions,
                    failures=failures,
                ),
                0.0,
            )
        return leader.close(0.0)

    order = list(range(ranks))
    baseline = run(order)
    order_seed.shuffle(order)  # type: ignore[attr-defined]
    assert run(order) == baseline
    # One outcome per parent, every tuple sorted.
    groups = [
        baseline.admitted,
        baseline.rejected,
        baseline.cancelled,
        baseline.completed,
        baseline.failed,
    ]
    seen = list(itertools.chain.from_iterable(groups))
    assert len(seen) == len(set(seen))
    for group in groups:
        assert list(group) == sorted(
            group, key=lambda p: (p.request_id, p.ctx_attempt, p.gen_attempt)
        )
    # Admitted iff every rank said ok and nobody cancelled or failed it.
    for name in proposed:
        everyone = all(name in news[r][0] for r in range(ranks))
        cancelled = name in client_cancels or any(name in news[r][1] for r in range(ranks))
        failed = any(name in news[r][3] for r in range(ranks))
        assert (pk(name) in baseline.admitted) == (everyone and not cancelled and not failed)


# -- the prepared -> decided channel (CTX: READY only when every rank prepared) ----


def _prepared_vote(round_no: int, rank: int, *prepared: str, cancels: tuple[str, ...] = ()) -> RoundVote:
    return msgspec.structs.replace(
        vote(round_no, rank, cancels=cancels), prepared=tuple(pk(n) for n in prepared)
    )


def test_decided_is_an_intersection_decided_once_and_not_an_ending() -> None:
    leader = RoundLeader(2)
    admit_all(leader, "a", "b")
    leader.open_round(now=0.0, timeout=T)
    leader.receive_vote(_prepared_vote(2, 0, "a", "b"), 0.0)
    leader.receive_vote(_prepared_vote(2, 1, "a"), 0.0)  # b not prepared on rank 1 yet
    decision = leader.close(0.0)
    assert names(decision.decided) == ["a"]
    assert leader.in_flight == {pk("a"), pk("b")}  # deciding settles nothing
    assert decision.settled() == frozenset()
    # Next round: both report both (sticky); only b is newly decided.
    leader.open_round(now=0.0, timeout=T)
    leader.receive_vote(_prepared_vote(3, 0, "a", "b"), 0.0)
    leader.receive_vote(_prepared_vote(3, 1, "a", "b"), 0.0)
    assert names(leader.close(0.0).decided) == ["b"]


def test_cancel_beats_decided_and_timeouts_decide_nothing() -> None:
    leader = RoundLeader(2)
    admit_all(leader, "a", "b")
    leader.open_round(now=0.0, timeout=T)
    leader.receive_vote(_prepared_vote(2, 0, "a", "b", cancels=("a",)), 0.0)
    leader.receive_vote(_prepared_vote(2, 1, "a", "b"), 0.0)
    decision = leader.close(0.0)
    assert names(decision.cancelled) == ["a"] and names(decision.decided) == ["b"]
    leader.open_round(now=0.0, timeout=T)
    leader.receive_vote(_prepared_vote(3, 0, "b"), 0.0)
    timed_out = leader.expire(T + 1.0)
    assert isinstance(timed_out, RoundTimedOut)
    assert timed_out.decision.decided == () and names(timed_out.decision.failed) == ["b"]


def test_follower_carries_prepared_into_its_vote() -> None:
    follower = RoundFollower(0, 0)
    proposal = RoundProposal(round_no=1)
    v = follower.vote(proposal, prepared=[pk("z"), pk("y")])
    assert names(v.prepared) == ["y", "z"]  # sorted, deterministic
