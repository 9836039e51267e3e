"""A CTX instance of two ranks (TP 2 -> 1 and TP 2 -> 2), driven through the
pair model: the shard map's edges, each CTX rank's own edges and pool, and
the CTX round that decides a parent only once every CTX rank reported it
prepared (the leader's intersection; a one-rank CTX instance decides alone).

The explorer's TP 2 worlds (`kvhandoff explore`) run the same model through
every interleaving; these tests pin the paths by hand, each one failing on a
mutant (tests/mutation/mutants.toml: `rounds-prepared-first-rank`).
"""

from __future__ import annotations

import pytest

from kvhandoff.protocol import CancelReason, DecodeReady, EdgeState, ParentState, Role
from kvhandoff.tools.pair_model import model_edges
from kvhandoff.topology import DEFAULT_LAYOUT, shard_map

from .harness import Pair, parent_key

P = parent_key(1)


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)])
def test_the_model_wires_the_runtime_shard_map(ctx_tp: int, gen_tp: int) -> None:
    """The model's edges are the rank actors' (`topology.shard_map`), and each
    CTX rank expects as many edges per parent as it has."""
    edges = model_edges(ctx_tp, gen_tp)
    assert edges == shard_map(DEFAULT_LAYOUT, ctx_tp, gen_tp).edges
    pair = Pair(n_ctx=ctx_tp, n_gen=gen_tp)
    for c, ctx in enumerate(pair.ctxs):
        assert ctx.edges_per_parent == len(pair.gens_of(c)) == sum(1 for e in edges if e[0] == c)
    assert [t.edge for t in pair.tickets(P)] == list(edges)


def _opened(pair: Pair) -> None:
    pair.admit(P, blocks=1, chunks=1)
    pair.prefill(P)
    pair.install(P)


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_the_ctx_round_decides_only_once_every_ctx_rank_is_prepared(gen_tp: int) -> None:
    pair = Pair(n_ctx=2, n_gen=gen_tp)
    _opened(pair)
    # Only CTX rank 0 hears its OPEN(s): it alone is prepared.
    to_rank1 = [e for e in pair.queue if e.to_role is Role.CTX and e.to_rank == 1]
    pair.queue = [e for e in pair.queue if e not in to_rank1]
    pair.deliver_all()
    assert pair.ctxs[0].is_prepared(P) and not pair.ctxs[1].is_prepared(P)
    pair.run_rounds()
    # No rank decided, nothing posted, no READY sent.
    assert [c.parent_state(P) for c in pair.ctxs] == [ParentState.RESIDENT, ParentState.RESIDENT]
    assert pair.in_flight == {} and pair.queue == []
    # Rank 1's OPEN lands: the round decides on both ranks at once.
    pair.queue = to_rank1
    pair.deliver_all()
    pair.run_rounds()
    assert [c.parent_state(P) for c in pair.ctxs] == [ParentState.DECIDED, ParentState.DECIDED]
    assert {w.ctx_rank for w in pair.in_flight.values()} == {0, 1}
    pair.pump()
    pair.run_rounds()
    assert all(g.parent_state(P) is ParentState.DECODE_READY for g in pair.gens)
    for parent in sorted(pair.decode_ready, key=repr):
        pair.free(parent)
    pair.settle_everything()
    for rank in pair.ranks():
        assert rank.parents() == {} and rank.pool.counts().free == rank.pool.counts().total


def test_a_cancel_on_one_ctx_rank_ends_the_handoff_on_every_rank() -> None:
    """CTX rank 1 cancels while both are prepared: its report carries the
    cancel, the round cancels on every rank (no decision), nothing is
    written and every pool comes back."""
    pair = Pair(n_ctx=2, n_gen=1)
    _opened(pair)
    pair.deliver_all()
    assert all(c.is_prepared(P) for c in pair.ctxs)
    rank1 = pair.ctxs[1]
    pair.perform(rank1.cancel(P, CancelReason.CLIENT, pair.now), rank1)
    pair.actions.clear()
    pair.run_rounds()
    assert pair.ctxs[0].parent_state(P) is not ParentState.DECIDED
    assert pair.in_flight == {}
    pair.settle_everything()
    assert not any(isinstance(a, DecodeReady) for a in pair.actions)
    for rank in pair.ranks():
        assert rank.parents() == {}, (rank.our.ns, rank.parents())
        assert rank.pool.counts().free == rank.pool.counts().total


def test_a_dead_ctx_rank_fails_the_handoff_and_its_shard_stays_quarantined_until_proven() -> None:
    """TP 2 -> 1, both ranks posting: CTX rank 1 dies with its chunk in
    flight. Its replacement fails the parent in the next CTX round; the
    survivor releases once its own chunk ends; the GEN rank keeps the
    blocks rank 1 may still write quarantined until the directory confirms
    the old incarnation dead, then every pool comes back (S1 all along)."""
    pair = Pair(n_ctx=2, n_gen=1)
    _opened(pair)
    pair.deliver_all()
    pair.run_rounds()
    assert {w.ctx_rank for w in pair.in_flight.values()} == {0, 1}
    pair.restart_ctx(1)
    gen = pair.gens[0]
    states = {t.edge: e.state for t, e in gen.edges(P).items()}
    assert states[(1, 0)] is EdgeState.UNKNOWN  # its writer is gone, its chunk unproven
    pair.pump()  # rank 0's chunk ends
    pair.run_rounds()  # the CTX round fails the parent (a rank was replaced)
    pair.check_s1()
    assert P not in pair.ctxs[0].parents()
    assert gen.parent_state(P) is ParentState.QUARANTINED
    pair.now += pair.timeout + 1
    pair.expire()
    pair.pump()
    assert gen.parent_state(P) is ParentState.QUARANTINED  # no proof yet: nothing reused
    pair.check_s1()
    pair.confirm_ctx_dead(1, 1)
    pair.settle_everything()
    for rank in pair.ranks():
        assert rank.parents() == {}, (rank.our.ns, rank.parents())
        assert rank.pool.counts().free == rank.pool.counts().total


def test_a_ctx_rank_death_in_one_instance_ends_no_handoff_of_another() -> None:
    """A fleet: two CTX instances (`ctx0`, `ctx1`) and one GEN instance, a
    handoff from each, both writing. `ctx1`'s rank dies: its handoff fails
    (and its GEN blocks wait for the death proof); `ctx0`'s completes, every
    byte of it, and is never failed or cancelled by any round."""
    pair = Pair(ctx_instances=2, gen_blocks=4, ctx_blocks=4)
    mine, theirs = parent_key(1), parent_key(2)
    for parent, instance in ((mine, 0), (theirs, 1)):
        pair.admit(parent, blocks=1, chunks=1, ctx_instance=instance)
        pair.prefill(parent)
        pair.install(parent)
    pair.deliver_all()
    for parent in (mine, theirs):
        pair.decide(parent)
    assert {w.ctx_rank for w in pair.in_flight.values()} == {0, 1}  # flat ranks: ctx0, ctx1
    pair.restart_ctx(1)  # ctx1's only rank
    assert pair.gens[0].parent_state(mine) is not ParentState.QUARANTINED
    pair.actions.clear()
    pair.pump()
    pair.run_rounds()
    assert mine in pair.decode_ready
    for key, leader in pair.leaders.items():
        assert mine not in leader.in_flight or key is Role.GEN, key
    pair.free(mine)
    pair.confirm_ctx_dead(1, 1)
    pair.settle_everything()
    assert theirs not in pair.decode_ready
    for rank in pair.ranks():
        assert rank.parents() == {}, (rank.our.ns, rank.parents())
        assert rank.pool.counts().free == rank.pool.counts().total
