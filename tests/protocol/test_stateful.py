"""Stateful exploration: TP 1 -> 2 and TP 2 -> 2 handoffs under random interleavings.

A Hypothesis RuleBasedStateMachine drives the pair harness (encoded frames on
the wire) through admit, prefill, install/OPEN, prepare, decide/READY, chunk
DONE and ERR, cancel from either side at any moment, rounds, timeouts and
lease expiry, stale / duplicate / reordered messages, and rank restarts with a
new epoch. After every step it checks:

* S1: every block a posted chunk may still touch (source on CTX, destination on
  GEN, by exact generation) is not FREE and not re-leased;
* S3: a message with a stale ticket, epoch, attempt or digest changes nothing,
  and neither does any message the protocol refuses;
* S4: every pool's blocks are each in exactly one state and counts add up;
* no leak: pool ownership equals the protocol's live parents, and at teardown
  everything settles to free + quarantined == pool.

A broken protocol shows up as an assertion that names the invariant it broke
(the harness converts a rank's KeyError/TypeError into "S3: ... must refuse
with a ProtocolError", a chunk posted for a released lease into "S1: ...",
a pool inconsistency into "S4: ..."), never as a KeyError of the harness;
`test_harness_reports_*` below pin that.
"""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvhandoff.protocol import (
    Cancel,
    CancelReason,
    Open,
    ParentKey,
    ParentState,
    PostChunk,
    Role,
    UnknownSessionError,
    decode_frame,
    encode_frame,
)

from .harness import Envelope, Pair, gen_endpoint, parent_key, protocol_call

N_GEN = 2
#: Rule arguments that pick a rank draw from this range (taken modulo the
#: ranks there are), so that the TP 2 -> 2 machine shares the rules.
ANY_RANK = st.integers(0, 7)


class HandoffMachine(RuleBasedStateMachine):
    """One CTX rank and two GEN ranks (the CTX rank decides alone)."""

    parents = Bundle("parents")
    N_CTX = 1

    @initialize(window=st.integers(1, 3))
    def setup(self, window: int) -> None:
        self.pair = Pair(
            n_ctx=self.N_CTX, n_gen=N_GEN, ctx_blocks=12, gen_blocks=12, chunk_window=window, timeout=10.0
        )
        self.next_id = 0

    # ---- lifecycle -----------------------------------------------------

    @precondition(
        lambda self: all(r.pool.counts().free >= 2 for r in self.pair.ranks())
    )
    @rule(target=parents, chunks=st.integers(1, 3))
    def admit(self, chunks: int) -> ParentKey:
        self.next_id += 1
        parent = parent_key(self.next_id)
        self.pair.admit(parent, blocks=2, chunks=chunks, lease=15.0)
        return parent

    @rule(parent=parents, rank=ANY_RANK)
    def prefill(self, parent: ParentKey, rank: int) -> None:
        c = rank % self.N_CTX
        if self._ctx_state(parent, c) is ParentState.ADMITTED:
            self.pair.prefill(parent, c)

    @rule(parent=parents)
    def install(self, parent: ParentKey) -> None:
        if all(self._gen_state(g, parent) is ParentState.ADMITTED for g in range(N_GEN)):
            self.pair.install(parent)

    @rule(parent=parents)
    def decide(self, parent: ParentKey) -> None:
        # A one-rank CTX instance decides a parent with every edge prepared
        # (several CTX ranks: their round does, in `rounds`).
        if self.pair.all_prepared(parent):
            self.pair.decide(parent)

    @rule(parent=parents)
    def advance(self, parent: ParentKey) -> None:
        """One lifecycle step for `parent` (keeps random runs reaching the DMA)."""
        admitted = [c for c in range(self.N_CTX) if self._ctx_state(parent, c) is ParentState.ADMITTED]
        if admitted:
            self.pair.prefill(parent, admitted[0])
        elif all(self._gen_state(g, parent) is ParentState.ADMITTED for g in range(N_GEN)):
            self.pair.install(parent)
        elif any(self._is_open_for(env, parent) for env in self.pair.queue):
            i = next(i for i, env in enumerate(self.pair.queue) if self._is_open_for(env, parent))
            self._deliver_checked(i)
        elif self.pair.all_prepared(parent):
            self.pair.decide(parent)
        elif self.N_CTX > 1 and self.pair.round_due(Role.CTX):
            self.pair.run_rounds()
        elif self.pair.in_flight:
            self.pair.finish_chunk(next(iter(self.pair.in_flight)))
        elif self.pair.queue:
            self._deliver_checked(0)

    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        if self.pair.queue:
            i = data.draw(st.integers(0, len(self.pair.queue) - 1))  # any order: reordering
            self._deliver_checked(i)

    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        if self.pair.queue:
            env = data.draw(st.sampled_from(self.pair.queue))
            self.pair.queue.append(Envelope(env.to_role, env.to_rank, env.frame))

    @rule(data=st.data(), ok=st.booleans())
    def finish_chunk(self, data: st.DataObject, ok: bool) -> None:
        if self.pair.in_flight:
            key = data.draw(st.sampled_from(sorted(self.pair.in_flight, key=repr)))
            self.pair.finish_chunk(key, ok=ok)

    @rule()
    def rounds(self) -> None:
        self.pair.run_rounds()
        for parent in sorted(self.pair.decode_ready, key=repr):
            self.pair.free(parent)
        self.pair.decode_ready.clear()

    # ---- cancellation and time -------------------------------------------

    @rule(parent=parents, side=ANY_RANK, reason=st.sampled_from(CancelReason))
    def cancel(self, parent: ParentKey, side: int, reason: CancelReason) -> None:
        ranks = self.pair.ranks()
        rank = ranks[side % len(ranks)]
        # A restarted incarnation never heard of the parent: that is the only refusal.
        with contextlib.suppress(UnknownSessionError):
            self.pair.perform(
                protocol_call(
                    "S3",
                    f"cancel({parent!r}) on {rank.our.ns}",
                    lambda: rank.cancel(parent, reason, self.pair.now),
                ),
                rank,
            )

    @rule(dt=st.sampled_from([0.5, 5.0, 10.0, 20.0]))
    def advance_time(self, dt: float) -> None:
        self.pair.now += dt
        self.pair.expire()

    # Restarts are drawn rarely (1 in 6) so that runs also get deep into the DMA.
    @rule(rank=ANY_RANK, notify=st.booleans(), dice=st.integers(0, 5))
    def restart_gen(self, rank: int, notify: bool, dice: int) -> None:
        if dice == 0:
            self.pair.restart_gen(rank % N_GEN, notify=notify)

    @rule(rank=ANY_RANK, notify=st.booleans(), dice=st.integers(0, 5))
    def restart_ctx(self, rank: int, notify: bool, dice: int) -> None:
        if dice == 0:
            self.pair.restart_ctx(rank % self.N_CTX, notify=notify)

    # ---- stale messages (S3) -------------------------------------------

    @rule(
        data=st.data(),
        mutation=st.sampled_from(
            ["gen_epoch", "ctx_epoch", "ctx_attempt", "gen_attempt", "digest", "request"]
        ),
    )
    def stale_message(self, data: st.DataObject, mutation: str) -> None:
        sent = [a for a in self.pair.actions if hasattr(a, "message")]
        if not sent:
            return
        action = data.draw(st.sampled_from(sent[-20:]))
        message = action.message  # type: ignore[union-attr]
        t = message.ticket
        r = msgspec.structs.replace
        bad = {
            "gen_epoch": lambda: r(
                t, gen=gen_endpoint(epoch=t.gen.epoch + 100, rank=t.gen.ns.rank)
            ),
            "ctx_epoch": lambda: r(t, ctx=r(t.ctx, epoch=t.ctx.epoch + 100)),
            "ctx_attempt": lambda: r(t, ctx_attempt=t.ctx_attempt + 1),
            "gen_attempt": lambda: r(t, gen_attempt=t.gen_attempt + 1),
            "digest": lambda: r(t, ctx_digest=bytes(32)),
            "request": lambda: r(t, request_id="ghost"),
        }[mutation]()
        stale = r(message, ticket=bad)
        role = action.to.ns.role  # type: ignore[union-attr]
        rank = action.to.ns.rank  # type: ignore[union-attr]
        before = [x.snapshot() for x in self.pair.ranks()]
        queued = len(self.pair.queue)
        error = self.pair.deliver_frame(role, rank, encode_frame(stale))
        assert error is not None, f"stale {mutation} message accepted: {stale}"
        if isinstance(stale, Open):
            del self.pair.queue[queued:]  # the REJECT answer; its effect is tested elsewhere
        assert [x.snapshot() for x in self.pair.ranks()] == before, (
            "S3: stale message changed state"
        )

    @rule(parent=consumes(parents))
    def forget(self, parent: ParentKey) -> None:
        """Stop naming a parent in new rules (it keeps living in the ranks)."""

    # ---- invariants ----------------------------------------------------

    @invariant()
    def s1_no_reuse_under_inflight_writes(self) -> None:
        self.pair.check_s1()

    @invariant()
    def s4_and_no_leak(self) -> None:
        self.pair.check_s4_and_ownership()

    def teardown(self) -> None:
        if not hasattr(self, "pair"):
            return
        pair = self.pair
        pair.settle_everything()
        pair.check_s1()
        pair.check_s4_and_ownership()
        for rank in pair.ranks():
            states = set(rank.parents().values())
            assert states <= {ParentState.QUARANTINED}, f"L1: {rank.our.ns} stuck in {states}"
            counts = rank.pool.counts()
            assert counts.leased == 0 and counts.free + counts.quarantined == counts.total  # L2

    # ---- helpers -------------------------------------------------------

    def _deliver_checked(self, i: int) -> None:
        env = self.pair.queue[i]
        before = [x.snapshot() for x in self.pair.ranks()]
        error = self.pair.deliver(i)
        if error is not None:
            # A refused message changes nothing (S3); an OPEN refusal only queues a REJECT.
            assert [x.snapshot() for x in self.pair.ranks()] == before, (
                f"refused {decode_frame(env.frame)} changed state"
            )
            assert env.to_role in (Role.CTX, Role.GEN)

    def _is_open_for(self, env: Envelope, parent: ParentKey) -> bool:
        if env.to_role is not Role.CTX:
            return False
        message = decode_frame(env.frame)
        return isinstance(message, Open) and message.ticket.parent == parent

    def _ctx_state(self, parent: ParentKey, rank: int = 0) -> ParentState | None:
        return self.pair.ctxs[rank].parents().get(parent)

    def _gen_state(self, rank: int, parent: ParentKey) -> ParentState | None:
        return self.pair.gens[rank].parents().get(parent)


def _machine_settings(max_examples: int) -> settings:
    """A run of `max_examples` programs of up to 50 steps each."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


HandoffMachine.TestCase.settings = _machine_settings(400)
TestHandoff = HandoffMachine.TestCase


class Tp22HandoffMachine(HandoffMachine):
    """Two CTX ranks and two GEN ranks, rank to rank: each CTX rank reports
    a parent prepared and the CTX round (the real leader) decides it."""

    N_CTX = 2


Tp22HandoffMachine.TestCase.settings = _machine_settings(250)
TestTp22Handoff = Tp22HandoffMachine.TestCase


# ---- the harness reports broken invariants, not its own KeyErrors ------------


def test_harness_reports_a_late_message_crash_as_s3() -> None:
    """A closed session left installed (a registry that forgets to close it) makes
    a late CANCEL find an edge whose parent is gone: the protocol raises KeyError.
    The harness reports that as the broken S3 refusal contract."""
    pair = Pair()
    parent = parent_key(1)
    pair.handoff(parent)
    pair.free(parent)
    ticket = pair.tickets(parent)[0]
    assert pair.ctx._sessions.closed_how(ticket) == "released"
    # Emulate the bug: the closed session is still live in the registry.
    pair.ctx._sessions._live[ticket] = object()  # type: ignore[assignment]
    with pytest.raises(AssertionError, match=r"^S3: ctx rank 0 receive\(Cancel req-1\) raised"):
        pair.deliver_message(Role.CTX, 0, Cancel(ticket=ticket, reason=CancelReason.PEER))


def test_harness_reports_a_post_for_a_released_lease_as_s1() -> None:
    """A PostChunk for a parent whose lease is gone is S1 (the DMA would read
    freed blocks), not a lookup error in the harness's data-plane model."""
    pair = Pair()
    parent = parent_key(1)
    pair.handoff(parent)
    ticket = pair.tickets(parent)[0]
    with pytest.raises(AssertionError, match="^S1: PostChunk 0"):
        pair.perform([PostChunk(ticket, 0)])


def test_harness_reports_pool_corruption_as_s4_and_leaks_as_no_leak() -> None:
    """A pool whose bookkeeping is broken fails as S4; a live parent whose lease
    is gone fails as "no leak"; neither as a PoolError/LeaseError of the harness."""
    pair = Pair()
    parent = parent_key(1)
    pair.admit(parent)
    pair.ctx.pool._queue_free(np.array([pair.ctx.lease(parent)[0].block]))  # a leased block on the free list
    with pytest.raises(AssertionError, match="^S4: pool of"):
        pair.check_s4_and_ownership()
    pair = Pair()
    pair.admit(parent)
    pair.ctx.pool.release(parent)  # the pool freed it behind the protocol's back
    with pytest.raises(AssertionError, match="^no leak:"):
        pair.check_s4_and_ownership()
