"""The rounds in the pair model are the real ones: each instance's
`RoundLeader`, one `RoundFollower` per rank, decisions applied through the
protocol's `decision_steps` / `apply_step` (what the rank actor runs).

These tests pin what the real leader decides and the model's rounds did not:
one outcome per parent (a cancel wins over a completion in the same round),
completions as an intersection over every rank of the instance, and the
failure of every in-flight parent when a rank of the instance is replaced.
"""

from __future__ import annotations

from kvhandoff.protocol import (
    DecodeReady,
    ParentKey,
    ParentState,
    Role,
    RoundDecision,
    Step,
    decision_steps,
)
from tests.protocol._helpers import decided, prepared
from tests.protocol.harness import Pair, parent_key

P = parent_key(1)


def _transferred(pair: Pair, parent: ParentKey = P) -> None:
    """Admit, prefill, open, decide and finish every chunk; no round yet."""
    decided(pair, parent)
    pair.pump()


def test_a_cancel_that_wins_the_round_over_a_completion_releases_without_decode() -> None:
    pair = Pair(n_gen=2)
    _transferred(pair)
    # Every GEN rank verified its bytes and reported the completion ...
    assert all(g.parent_state(P) is ParentState.SETTLED for g in pair.gens)
    # ... and the client's cancel comes before the completion round.
    pair.client_cancel(P)
    pair.actions.clear()
    pair.run_rounds()
    # One outcome per parent: the cancel wins, the KV is never handed over,
    # and the parent (SETTLED, cancel decided) is released at once.
    assert not [a for a in pair.actions if isinstance(a, DecodeReady)]
    for rank in pair.ranks():
        assert P not in rank.parents(), (rank.our.ns, rank.parents())
        assert rank.pool.counts().free == rank.pool.counts().total
    assert not pair.rounds_due()


def test_a_gen_completion_needs_every_gen_rank() -> None:
    pair = decided(Pair(n_gen=2))
    # Every frame and chunk runs, except what reaches GEN rank 1.
    for _ in range(20):
        for i, env in enumerate(pair.queue):
            if env.to_role is Role.CTX or env.to_rank == 0:
                pair.deliver(i)
                break
        else:
            if not any(k[0].gen.ns.rank == 0 for k in pair.in_flight):
                break
            pair.finish_chunk(next(k for k in pair.in_flight if k[0].gen.ns.rank == 0))
    assert pair.gens[0].parent_state(P) is ParentState.SETTLED
    assert pair.gens[1].parent_state(P) is not ParentState.SETTLED
    assert not pair.round_due(Role.GEN), "one rank's completion decides nothing"
    pair.pump()
    assert pair.round_due(Role.GEN)
    pair.run_rounds()
    assert all(g.parent_state(P) is ParentState.DECODE_READY for g in pair.gens)


def test_a_replaced_gen_rank_fails_every_parent_in_flight_on_its_instance() -> None:
    pair = prepared(Pair(n_gen=2))
    pair.restart_gen(1)
    # The new incarnation holds nothing of P; the survivor's shard is useless.
    assert pair.round_due(Role.GEN)
    pair.run_rounds()
    assert P not in pair.leaders[Role.GEN].in_flight
    assert pair.gens[0].parent_state(P) is not ParentState.RESIDENT
    pair.settle_everything()
    for rank in pair.ranks():
        assert P not in rank.parents() or rank.parents()[P] is ParentState.QUARANTINED


def test_decision_steps_name_each_live_parent_once_in_apply_order() -> None:
    a, b, c, d, e, f, gone = (parent_key(n) for n in range(1, 8))
    decision = RoundDecision(
        round_no=1,
        rejected=(a,),
        admitted=(b,),
        decided=(c,),
        cancelled=(d, gone),
        failed=(e,),
        completed=(f,),
    )
    live = {a, b, c, d, e, f}
    assert decision_steps(decision, live) == [
        (Step.WITHDRAW, a),
        (Step.ADMITTED, b),
        (Step.DECIDED, c),
        (Step.CANCELLED, d),
        (Step.FAILED, e),
        (Step.COMPLETED, f),
    ]
    assert decision_steps(decision, set()) == []
