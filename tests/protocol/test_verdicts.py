"""The rank's verdicts are the protocol's (issue 22 item 1): how a rank votes
on an admission (`admission_verdict`), what an action tells its round
follower (`report_of`, `RoundFollower.record`), and the session queries the
shell asks before it acts (`is_admitted`, `may_post`, `may_scatter`,
`may_be_written`, `at_rest`, `unbind_unopened`). The rank actor performs
them; it never tests a session's state itself (tests/test_repo.py greps
for that). Each test here fails if its rule changes."""

from __future__ import annotations

import pytest

from kvhandoff.protocol import (
    AbiMismatchError,
    AdmissionStop,
    CancelIntent,
    CancelReason,
    Capability,
    LocalOutcome,
    Negotiated,
    News,
    NotNegotiatedError,
    ParentSettled,
    ParentState,
    Quarantine,
    Release,
    Role,
    RoundFollower,
    VersionMismatchError,
    admission_verdict,
    report_of,
)
from tests.protocol._helpers import prepared
from tests.protocol.harness import Pair, parent_key

P = parent_key(1)
AGREED = Negotiated(version=1, capabilities=Capability(0), abi="msgspec-1")


# -- admission_verdict -------------------------------------------------------------


def test_an_agreed_pair_admits() -> None:
    v = admission_verdict(stopped=False, peer="gen-a", paired=True, negotiation=AGREED)
    assert v.admit and v.refusal == "" and not v.renegotiate


def test_a_stopped_rank_refuses_before_anything_else() -> None:
    v = admission_verdict(stopped=True, peer="gen-a", paired=True, negotiation=AGREED)
    assert (v.admit, v.refusal) == (False, "admit_refused_stopped")


@pytest.mark.parametrize(
    ("peer", "paired", "left", "admits_unpaired"),
    [
        ("gen-x", False, False, False),  # an instance we do not pair with
        ("gen-x", False, False, True),  # named but unknown: refused even where unpaired is allowed
        ("gen-a", True, True, False),  # it left the fleet
        ("", False, False, False),  # names none, and this rank needs a pair
    ],
)
def test_an_unknown_or_departed_instance_is_refused(
    peer: str, paired: bool, left: bool, admits_unpaired: bool
) -> None:
    v = admission_verdict(
        stopped=False, peer=peer, paired=paired, left=left,
        admits_unpaired=admits_unpaired, negotiation=AGREED if paired else None,
    )
    assert (v.admit, v.refusal) == (False, "refused_unknown_instance")


def test_an_unpaired_admission_is_admitted_where_the_rank_accepts_them() -> None:
    # A published engine ticket: its pair is checked at its first OPEN.
    assert admission_verdict(stopped=False, peer="", paired=False, admits_unpaired=True).admit


def test_a_pending_negotiation_refuses_and_asks_again() -> None:
    v = admission_verdict(stopped=False, peer="gen-a", paired=True, negotiation=NotNegotiatedError(1, 3))
    assert (v.admit, v.refusal, v.renegotiate) == (False, "refused_negotiation_pending", True)


@pytest.mark.parametrize(
    ("error", "kind"),
    [(VersionMismatchError(((1,), (2,))), "version"), (AbiMismatchError(("a", "b")), "abi")],
)
def test_a_refused_negotiation_refuses_without_asking_again(error: Exception, kind: str) -> None:
    v = admission_verdict(stopped=False, peer="gen-a", paired=True, negotiation=error)  # type: ignore[arg-type]
    assert (v.admit, v.refusal, v.renegotiate) == (False, f"refused_negotiation_{kind}", False)


# -- report_of and RoundFollower.record ---------------------------------------------


def _never(_parent: object) -> bool:
    raise AssertionError("verified() asked for a parent that did not settle with success")


def test_a_cancel_intent_is_cancel_news() -> None:
    r = report_of(CancelIntent(P, CancelReason.CLIENT), _never)
    assert r is not None and (r.parent, r.news, r.outcome) == (P, News.CANCEL, None)


def test_an_admission_stop_is_failure_news() -> None:
    r = report_of(AdmissionStop(P, "quarantine"), _never)
    assert r is not None and (r.news, r.outcome) == (News.FAILURE, None)


def test_a_cancelled_settle_tells_the_rounds_nothing_and_does_not_override() -> None:
    r = report_of(ParentSettled(P, True, ()), _never)
    assert r is not None and (r.news, r.outcome, r.overrides) == (None, LocalOutcome.CANCELLED, False)


def test_a_settle_whose_bytes_verify_is_a_completion() -> None:
    r = report_of(ParentSettled(P, False, ()), lambda parent: parent == P)
    assert r is not None and (r.news, r.outcome) == (News.COMPLETION, None)


def test_a_settle_whose_bytes_do_not_verify_fails_and_overrides() -> None:
    # S2: bytes that do not verify never reach decode, whatever came before.
    r = report_of(ParentSettled(P, False, ()), lambda _parent: False)
    assert r is not None and (r.news, r.outcome, r.overrides) == (News.FAILURE, LocalOutcome.FAILED, True)


def test_other_actions_tell_the_rounds_nothing() -> None:
    assert report_of(Release(P, ()), _never) is None
    assert report_of(Quarantine(P, (), "unproven"), _never) is None


@pytest.mark.parametrize("news", list(News))
def test_the_follower_records_each_news_where_its_vote_carries_it(news: News) -> None:
    follower = RoundFollower(0, 1)
    follower.record(news, P)
    vote = follower.vote_with_news(_proposal(follower), admit_ok=())
    carried = {
        News.CANCEL: vote.cancels,
        News.FAILURE: vote.failures,
        News.COMPLETION: vote.completions,
    }
    assert {n for n, parents in carried.items() if P in parents} == {news}


def _proposal(follower: RoundFollower):  # type: ignore[no-untyped-def]
    from kvhandoff.protocol import RoundProposal

    return RoundProposal(round_no=follower.last_applied + 1)


# -- the session queries the shell asks ----------------------------------------------


def test_is_admitted_holds_from_the_vote_until_prefill() -> None:
    pair = Pair()
    pair.admit(P)
    assert pair.ctx.is_admitted(P) and all(g.is_admitted(P) for g in pair.gens)
    pair.prefill(P)
    assert not pair.ctx.is_admitted(P)
    pair.install(P)
    assert not any(g.is_admitted(P) for g in pair.gens)  # installed: its OPENs went out


def test_may_scatter_only_into_an_installed_held_lease() -> None:
    pair = Pair()
    gen = pair.gens[0]
    assert not gen.may_scatter(P)  # never admitted
    pair.admit(P)
    assert not gen.may_scatter(P)  # admitted, not installed
    pair.prefill(P)
    pair.install(P)
    assert gen.may_scatter(P) and gen.may_be_written()
    pair.client_cancel(P)
    pair.run_rounds()
    assert not gen.may_scatter(P)  # cancelled: never write an ended lease (S1)


def test_may_post_only_while_the_edge_is_posting() -> None:
    pair = prepared(Pair())
    (ticket,) = pair.tickets(P)
    assert not pair.ctx.may_post(ticket)  # prepared, not decided
    pair.decide(P)
    assert pair.ctx.may_post(ticket)
    pair.client_cancel(P)
    pair.run_rounds()
    assert not pair.ctx.may_post(ticket)
    assert not pair.ctx.may_post(pair.tickets(parent_key(9))[0])  # unknown: no error, False


def test_at_rest_once_the_outcome_cannot_change() -> None:
    pair = Pair()
    assert pair.ctx.at_rest(P)  # not live
    pair.admit(P)
    assert not pair.ctx.at_rest(P) and not pair.gens[0].at_rest(P)
    pair.prefill(P)
    pair.install(P)
    pair.deliver_all()
    pair.decide(P)
    pair.pump()
    pair.run_rounds()
    assert pair.gens[0].parent_state(P) is ParentState.DECODE_READY
    assert pair.gens[0].at_rest(P)


def test_unbind_unopened_only_before_an_edge_is_recorded() -> None:
    pair = Pair()
    pair.admit(P)
    pair.prefill(P)
    pair.ctx.bind_edges(P, 1)
    assert pair.ctx.unbind_unopened(P)
    pair.ctx.bind_edges(P, 1)  # bindable again
    pair.install(P)
    pair.deliver_all()
    assert not pair.ctx.unbind_unopened(P)  # an edge is recorded: it stays bound
    assert not pair.ctx.unbind_unopened(parent_key(9))  # not live


def test_phase_and_quarantined_parents() -> None:
    pair = Pair()
    assert pair.ctx.phase(P) is None
    pair.admit(P)
    phase = pair.ctx.phase(P)
    assert phase is not None and phase["state"] == "admitted" and phase["edges"] == []
    assert pair.ctx.quarantined_parents() == []


# -- pairing two instances' admissions ------------------------------------------


def test_the_pairing_vetoes_what_the_peer_did_not_admit_and_undoes_what_we_did_not() -> None:
    from kvhandoff.protocol import paired_outcome, pairing_undo, pairing_veto

    a, b, c = parent_key(1), parent_key(2), parent_key(3)
    assert pairing_veto([a, b, c], {a, c}) == {b}
    assert pairing_veto([a], {a}) == frozenset()
    assert pairing_undo([a, b, c], {b}) == [a, c]
    assert pairing_undo([a], {a}) == []
    assert paired_outcome("rejected", peer_failed=True) == "failed"
    assert paired_outcome("rejected", peer_failed=False) == "rejected"
    assert paired_outcome("completed", peer_failed=True) == "completed"


@pytest.mark.parametrize("short", ["ctx", "gen"])
def test_an_admission_one_instance_refuses_ends_on_both(short: str) -> None:
    """One instance has no block left for a second handoff: the pairing
    vetoes it on the GEN side (CTX short) or undoes the CTX's admission in
    the next CTX round (GEN short); nothing of it stays leased anywhere."""
    pair = Pair(ctx_blocks=1 if short == "ctx" else 4, gen_blocks=1 if short == "gen" else 4)
    first, second = parent_key(1), parent_key(2)
    pair.admit(first, blocks=1, chunks=1)
    pair.admit(second, blocks=1, chunks=1)
    assert second not in pair.gens[0].parents()
    if short == "gen":
        assert second in pair.ctx.parents()  # admitted alone, for now
        pair.run_rounds()  # the undo: a cancel in the next CTX round
    assert second not in pair.ctx.parents()
    assert second not in pair.leaders[Role.CTX].in_flight | pair.leaders[Role.GEN].in_flight
    assert first in pair.ctx.parents() and first in pair.gens[0].parents()
