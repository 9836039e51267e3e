"""Group commit, sans-IO: pushed rank reports, rounds decided from them,
admissions vetoed by the peer instance, and the follower's intent bookkeeping.

Every test drives `RoundLeader` / `RoundFollower` with plain floats for time.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvhandoff.protocol import (
    AdmissionRequest,
    ParentKey,
    RankReport,
    RoundDecision,
    RoundError,
    RoundFollower,
    RoundLeader,
    RoundVote,
    VoteRejected,
    VoteRejectReason,
)

T = 1.0


def pk(name: str) -> ParentKey:
    return ParentKey(request_id=name, ctx_attempt=1, gen_attempt=1)


def admit(leader: RoundLeader, *names: str) -> None:
    """Admit `names` through a full vote round (every rank agrees)."""
    proposal = leader.open_round([AdmissionRequest(parent=pk(n), num_tokens=16) for n in names], now=0.0, timeout=T)
    for rank in leader.ranks:
        leader.receive_vote(
            RoundVote(round_no=proposal.round_no, rank=rank, epoch=leader.epoch_of(rank), admit_ok=tuple(pk(n) for n in names)),
            0.0,
        )
    assert set(leader.close().admitted) == {pk(n) for n in names}


def report(rank: int, seq: int, *, epoch: int = 0, **sets: tuple[str, ...]) -> RankReport:
    return RankReport(rank=rank, epoch=epoch, seq=seq, **{k: tuple(pk(n) for n in v) for k, v in sets.items()})


def decide_from_reports(leader: RoundLeader):
    leader.open_round(now=0.0, timeout=T)
    assert leader.votes_from_reports(0.0)
    return leader.close()


# -- the leader ---------------------------------------------------------------------------


def test_completion_needs_every_ranks_report_and_the_first_alone_decides_nothing() -> None:
    leader = RoundLeader(2)
    admit(leader, "a")
    assert leader.report(report(0, 1, completions=("a",)))
    assert not leader.reports_decide()  # rank 1 has not reported it: skip the round
    assert leader.report(report(1, 1, completions=("a",)))
    assert leader.reports_decide()
    decision = decide_from_reports(leader)
    assert decision.completed == (pk("a"),)
    assert pk("a") not in leader.in_flight
    # The stored reports still name it; the leader's default-deny drops that now.
    assert not leader.reports_decide()
    assert decide_from_reports(leader).completed == ()


def test_prepared_reports_decide_once() -> None:
    leader = RoundLeader(2)
    admit(leader, "p")
    leader.report(report(0, 1, prepared=("p",)))
    assert not leader.reports_decide()
    leader.report(report(1, 1, prepared=("p",)))
    assert leader.reports_decide()  # every rank prepared: this round decides it
    assert decide_from_reports(leader).decided == (pk("p"),)
    assert not leader.reports_decide()  # decided once: stale prepared reports are nothing


def test_one_ranks_cancel_report_is_enough_and_unknown_parents_are_dropped() -> None:
    leader = RoundLeader(3)
    admit(leader, "c")
    leader.report(report(2, 1, cancels=("c", "never-admitted")))
    assert leader.reports_decide()
    decision = decide_from_reports(leader)
    assert decision.cancelled == (pk("c"),)  # a union; default-deny drops the other


def test_an_older_report_never_replaces_a_newer_one() -> None:
    leader = RoundLeader(1)
    admit(leader, "x")
    assert leader.report(report(0, 5, completions=("x",)))
    assert not leader.report(report(0, 4))  # older: ignored, the newer one stays
    assert not leader.report(report(0, 5))  # the same: ignored
    assert decide_from_reports(leader).completed == (pk("x"),)


@pytest.mark.parametrize(
    ("rank", "epoch", "reason"),
    [(0, 0, VoteRejectReason.STALE_EPOCH), (0, 9, VoteRejectReason.UNKNOWN_EPOCH), (7, 1, VoteRejectReason.UNKNOWN_RANK)],
)
def test_a_report_of_another_incarnation_is_refused_and_changes_nothing(rank: int, epoch: int, reason) -> None:
    leader = RoundLeader(2, epochs={0: 1, 1: 1})
    admit(leader, "a")
    leader.report(report(1, 1, epoch=1, completions=("a",)))
    with pytest.raises(VoteRejected) as info:
        leader.report(report(rank, 1, epoch=epoch, completions=("a",)))
    assert info.value.reason is reason
    assert not leader.reports_decide()  # rank 0's share never counted


def test_a_restart_voids_the_old_incarnations_report() -> None:
    leader = RoundLeader(2)
    admit(leader, "a")
    leader.report(report(0, 1, completions=("a",)))
    leader.report(report(1, 1, completions=("a",)))
    leader.set_epoch(1, 1)
    assert not leader.reports_decide()  # the new incarnation has not reported
    assert decide_from_reports(leader).completed == ()


def test_a_round_with_admissions_needs_every_ranks_own_vote() -> None:
    leader = RoundLeader(1)
    leader.open_round([AdmissionRequest(parent=pk("a"), num_tokens=16)], now=0.0, timeout=T)
    with pytest.raises(RoundError):
        leader.votes_from_reports(0.0)
    assert leader.missing() == (0,)  # nothing was voted on its behalf


def test_vetoed_admissions_are_rejected_whatever_the_votes_say() -> None:
    leader = RoundLeader(2)
    proposal = leader.open_round(
        [AdmissionRequest(parent=pk(n), num_tokens=16) for n in ("ok", "peer-refused")], now=0.0, timeout=T
    )
    for rank in (0, 1):
        leader.receive_vote(
            RoundVote(round_no=proposal.round_no, rank=rank, epoch=0, admit_ok=(pk("ok"), pk("peer-refused"))), 0.0
        )
    decision = leader.close(vetoed=[pk("peer-refused")])
    assert decision.admitted == (pk("ok"),)
    assert decision.rejected == (pk("peer-refused"),)
    assert leader.in_flight == {pk("ok")}


@settings(max_examples=200, deadline=None)
@given(
    reported=st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abcd"), st.sampled_from(["cancels", "completions", "prepared", "failures"])), max_size=12)
)
def test_reports_decide_is_exactly_whether_the_round_would_decide_something(reported) -> None:
    """The skip rule never skips a round that would decide something, and
    never runs one that decides nothing (a model check against `close`)."""
    leader = RoundLeader(3)
    admit(leader, "a", "b", "c")
    sets: dict[int, dict[str, set[str]]] = {r: {} for r in range(3)}
    for rank, name, kind in reported:
        sets[rank].setdefault(kind, set()).add(name)
    for rank, kinds in sets.items():
        leader.report(report(rank, 1, **{k: tuple(sorted(v)) for k, v in kinds.items()}))
    predicted = leader.reports_decide()
    decision = decide_from_reports(leader)
    assert predicted == bool(decision.settled() or decision.decided)


# -- the follower -------------------------------------------------------------------------


def test_follower_reports_its_intents_with_growing_sequence_numbers() -> None:
    follower = RoundFollower(1, 3)
    follower.record_cancel(pk("c"))
    follower.record_completion(pk("d"))
    first = follower.report()
    follower.record_prepared(pk("p"))
    second = follower.report()
    assert (first.rank, first.epoch) == (1, 3)
    assert second.seq > first.seq
    assert first.cancels == (pk("c"),) and first.completions == (pk("d"),) and first.prepared == ()
    assert second.prepared == (pk("p"),)


def test_settled_parents_leave_every_intent_set() -> None:
    leader = RoundLeader(1)
    follower = RoundFollower(0, 0)
    admit(leader, "a", "b")
    follower.apply(_decision(leader, 1))  # the admission round, as the rank applied it
    follower.record_completion(pk("a"))
    follower.record_cancel(pk("b"))
    follower.record_prepared(pk("a"))
    leader.report(follower.report())
    decision = decide_from_reports(leader)
    assert set(decision.settled()) == {pk("a"), pk("b")}
    follower.apply(decision)
    assert not follower.has_news()


def _decision(leader: RoundLeader, round_no: int) -> RoundDecision:
    return RoundDecision(round_no=round_no)


def test_forget_drops_union_intents_about_parents_no_longer_held_only() -> None:
    follower = RoundFollower(0, 0)
    follower.record_cancel(pk("gone"))
    follower.record_failure(pk("gone"))
    follower.record_cancel(pk("held"))
    follower.record_completion(pk("gone"))  # an intersection: kept until settled
    follower.forget(lambda p: p == pk("held"))
    got = follower.report()
    assert got.cancels == (pk("held"),) and got.failures == ()
    assert got.completions == (pk("gone"),)


def test_join_keeps_intents_and_refuses_a_follower_that_took_part() -> None:
    follower = RoundFollower(0, 2)
    follower.record_cancel(pk("early"))
    follower.join(7)
    assert follower.next_round == 7
    assert follower.report().cancels == (pk("early"),)
    follower.apply(_decision(RoundLeader(1), 7))
    with pytest.raises(RoundError):
        follower.join(9)


def test_reports_waiting_names_an_intersection_some_rank_has_not_reported() -> None:
    """The coordinator probes every rank when this stays true (a dead rank
    holding its share); it is false with no reports, once decided, and for
    parents not in flight."""
    leader = RoundLeader(2)
    admit(leader, "a")
    assert not leader.reports_waiting()
    leader.report(report(0, 1, completions=("a", "not-in-flight")))
    assert leader.reports_waiting()  # rank 1's share is missing
    leader.report(report(1, 1, completions=("a",)))
    decide_from_reports(leader)
    assert not leader.reports_waiting()  # completed: nothing waits
    admit(leader, "p")
    leader.report(report(0, 2, prepared=("p",)))
    assert leader.reports_waiting()
    leader.report(report(1, 2, prepared=("p",)))
    decide_from_reports(leader)
    assert not leader.reports_waiting()  # decided once: stale prepared reports wait for nothing


# -- a one-rank instance's admissions made alone -----------------------------------------


def test_a_one_rank_instance_admitted_alone_is_in_flight_from_the_report_and_decided_like_any() -> None:
    leader = RoundLeader(1)
    assert leader.report(report(0, 1, admitted=("a",)))
    assert leader.in_flight == {pk("a")}
    # Its news counts as for a parent a round admitted: a completion ends it.
    assert leader.report(report(0, 2, admitted=("a",), completions=("a",)))
    decision = decide_from_reports(leader)
    assert decision.completed == (pk("a"),)
    assert leader.in_flight == set()


def test_a_report_written_before_the_end_was_applied_never_takes_an_ended_parent_back() -> None:
    leader = RoundLeader(1)
    follower = RoundFollower(0, 0)
    follower.record_admitted(pk("a"))
    assert leader.report(follower.report())
    late = follower.report()  # still names "a": written before the rank applies the cancel
    leader.open_round(cancels=[pk("a")], now=0.0, timeout=T)
    leader.votes_from_reports(0.0)
    decision = leader.close()
    assert decision.cancelled == (pk("a"),)
    # The report sent before the rank applied the cancel comes in after it.
    assert leader.report(late)
    assert pk("a") not in leader.in_flight, "an ended parent was taken in flight again"
    # Once the rank applied the end, its reports no longer name it, and the
    # leader forgets it (bounded): nothing is left of "a".
    follower.apply(decision)
    assert follower.report().admitted == ()
    assert leader.report(follower.report())
    assert pk("a") not in leader.in_flight and not leader._alone_ended  # noqa: SLF001


def test_only_a_one_rank_instance_may_report_admissions_made_alone() -> None:
    leader = RoundLeader(2)
    with pytest.raises(VoteRejected) as refused:
        leader.report(report(0, 1, admitted=("a",)))
    assert refused.value.reason is VoteRejectReason.NOT_ALONE
    assert leader.in_flight == set() and not leader.reports_decide()


def test_a_parent_proposed_in_the_open_round_or_in_flight_is_not_taken_twice() -> None:
    leader = RoundLeader(1)
    admit(leader, "b")
    proposal = leader.open_round([AdmissionRequest(parent=pk("c"), num_tokens=16)], now=0.0, timeout=T)
    assert leader.report(report(0, 1, admitted=("b", "c")))
    assert leader.in_flight == {pk("b")}  # "c" stays the open round's to decide
    leader.receive_vote(RoundVote(round_no=proposal.round_no, rank=0, epoch=0), 0.0)
    assert leader.close().rejected == (pk("c"),)
    assert leader.in_flight == {pk("b")}


def test_the_follower_reports_an_admission_made_alone_until_a_decision_ends_it() -> None:
    """Held here or not: the rank released "b" (cancelled) before its report
    went out, and the leader must still learn of it and of its cancel, or
    it never takes it in flight to end it (or holds it for good if an
    earlier report named it)."""
    follower = RoundFollower(0, 0)
    follower.record_admitted(pk("a"))
    follower.record_admitted(pk("b"))
    assert follower.has_news()
    assert follower.report().admitted == (pk("a"), pk("b"))
    follower.apply(RoundDecision(round_no=1, completed=(pk("a"),)))
    assert follower.report().admitted == (pk("b"),)
    follower.record_cancel(pk("b"))
    follower.forget(lambda p: False)  # released here
    got = follower.report()
    assert got.admitted == (pk("b"),) and got.cancels == (pk("b"),)
    leader = RoundLeader(1)
    assert leader.report(got)
    decision = decide_from_reports(leader)
    assert decision.cancelled == (pk("b"),) and leader.in_flight == set()
    follower.apply(RoundDecision(round_no=2, cancelled=(pk("b"),)))
    assert follower.report().admitted == () and not follower.has_news()


def test_a_cancel_of_a_parent_the_rank_released_rides_until_the_leader_decides_it() -> None:
    """A GEN rank quarantined a parent (its writer died), recorded the
    cancel, and reclaimed it at the death proof before a round decided the
    cancel; a decision about something else came meanwhile. The leader
    still holds the parent: the cancel must stay in the rank's reports until
    a decision ends it (it was dropped, and the handoff hung: L1)."""
    leader = RoundLeader(1)
    follower = RoundFollower(0, 0)
    proposal = leader.open_round([AdmissionRequest(parent=pk("p"), num_tokens=16)], now=0.0, timeout=T)
    leader.receive_vote(follower.vote_with_news(proposal, admit_ok=[pk("p")]), 0.0)
    admitted = leader.close()
    follower.apply(admitted)
    assert leader.in_flight == {pk("p")}
    follower.record_cancel(pk("p"))
    follower.apply(RoundDecision(round_no=2))  # a round that did not see the cancel
    follower.forget(lambda p: False)  # reclaimed and released here
    leader.open_round(now=0.0, timeout=T)  # round 2, empty
    leader.votes_from_reports(0.0)
    assert leader.close().round_no == 2
    got = follower.report()
    assert got.cancels == (pk("p"),), "the cancel of a parent the leader holds was forgotten"
    assert leader.report(got) and leader.reports_decide()
    decision = decide_from_reports(leader)
    assert decision.cancelled == (pk("p"),) and leader.in_flight == set()
    follower.apply(decision)
    follower.forget(lambda p: False)
    assert not follower.has_news()


# -- rounds that are not atomic: news recorded while a round is open ----------------------

_OPS = st.lists(
    st.tuples(st.sampled_from(["cancel", "release", "send", "deliver", "open", "close", "apply"]), st.integers(0, 1)),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
@example([("open", 0), ("cancel", 0), ("release", 0), ("close", 0), ("apply", 0)])  # the chaos run's hang
def test_every_cancel_a_rank_records_is_decided_whatever_the_interleaving(ops) -> None:
    """A one-rank instance with two parents in flight. The runtime's rounds
    are not atomic: between a round's opening and the rank's apply of its
    decision, the rank records cancels, releases parents (a quarantine
    reclaimed at a death proof), and its reports travel late. Whatever the
    interleaving, once the traffic drains, every parent whose cancel the
    rank recorded has been decided (L1). With `forget` dropping news of
    every parent no longer held, a round that opened before the cancel and
    was applied after the release lost it, and the parent stayed in flight
    at the leader for good."""
    leader = RoundLeader(1)
    follower = RoundFollower(0, 0)
    parents = [pk("a"), pk("b")]
    proposal = leader.open_round([AdmissionRequest(parent=p, num_tokens=16) for p in parents], now=0.0, timeout=T)
    leader.receive_vote(follower.vote_with_news(proposal, admit_ok=parents), 0.0)
    follower.apply(leader.close())
    held = set(parents)
    cancelled: set[ParentKey] = set()
    wire: list[RankReport] = []  # reports sent, in order, not delivered yet
    decided: list[RoundDecision] = []  # closed, not applied yet (at most one)
    open_round = False

    def apply_next() -> None:
        decision = decided.pop(0)
        follower.apply(decision)
        held.difference_update(decision.settled())
        follower.forget(held.__contains__)

    for op, i in ops:
        parent = parents[i]
        if op == "cancel" and parent in held and parent in leader.in_flight:
            follower.record_cancel(parent)
            cancelled.add(parent)
        elif op == "release" and parent in cancelled and parent in held:
            held.discard(parent)  # the rank let it go before any decision said so
        elif op == "send":
            wire.append(follower.report())
        elif op == "deliver" and wire:
            leader.report(wire.pop(0))
        elif op == "open" and not open_round and not decided:
            leader.open_round(now=0.0, timeout=T)
            open_round = True
        elif op == "close" and open_round:
            leader.votes_from_reports(0.0)
            decided.append(leader.close())
            open_round = False
        elif op == "apply" and decided:
            apply_next()
    # Drain: the reports in flight arrive, the open round ends, and the rank
    # goes on reporting and the leader on deciding until nothing changes.
    while wire:
        leader.report(wire.pop(0))
    if open_round:
        leader.votes_from_reports(0.0)
        decided.append(leader.close())
    while decided:
        apply_next()
    for _ in range(3):
        leader.report(follower.report())
        leader.open_round(now=0.0, timeout=T)
        leader.votes_from_reports(0.0)
        decided.append(leader.close())
        apply_next()
    assert not (cancelled & leader.in_flight), f"cancels never decided: {cancelled & leader.in_flight}"
