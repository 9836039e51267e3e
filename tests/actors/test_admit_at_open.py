"""Admission at the OPEN on real rank actors (docs/design.md "Admission at
the OPEN"; a fleet's default): a CTX instance of one rank admits a handoff
when its OPEN arrives, a GEN coordinator asks it no admission once it
learned that of the pair, and the CTX coordinator learns of each admission
from its rank's report. CTX instances of several ranks admit in rounds, in
the same fleet.

What would fail if it broke:

* the handoffs over every pair of a mixed fleet (CTX tp=1 and tp=2, GEN
  tp=1 and tp=2) complete with verified bytes (S2); those of the tp=1 CTX
  instance are admitted at their OPENs with no peer admission and no vote
  there, those of the tp=2 one in its rounds; every pool is whole
  afterwards: the CTX coordinators ended what they only heard of in
  reports (L1);
* a CTX rank without room refuses an OPEN with a REJECT while another
  handoff holds its blocks mid-transfer: that handoff ends "rejected" (as
  a round's refusal), its GEN blocks come back, the held one completes,
  nothing leaks; a copy of the refused OPEN that comes once there is room
  is refused too (the REJECT promised that nothing writes under its
  ticket: admitted then, the CTX would write into GEN blocks given back);
* a draining CTX instance's rank refuses an OPEN that reaches it anyway
  (a GEN coordinator asked directly, past the fleet's routing), and its
  coordinator's drain waits for the handoff its rank admitted before (it
  learns of it from the rank's answer, not from a report yet to come);
* a rank its coordinator has not taken into its rounds admits nothing;
* a one-rank GEN instance paired with such a CTX instance admits alone
  (`admit_alone`, no round): the traced path is six hops with no vote, a
  refusal for want of room is "rejected" with nothing held;
* `admit_at_open=False` turns the path off, and a bad value is refused
  before anything starts.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvhandoff.actors import InvalidConfig
from kvhandoff.actors._faults import FaultPlan
from kvhandoff.actors.fleet import Fleet
from kvhandoff.protocol import ParentKey
from kvhandoff.topology import KVLayout

from .helpers import assert_clean, inside

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

TOKENS = 40  # 3 blocks of 16 tokens
TIMEOUT = 60.0
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", tokens_per_block=16)
FLEET = dict(layout=LAYOUT, round_timeout_s=20.0, transfer_timeout_s=10.0, lease_timeout_s=20.0, start_timeout_s=300.0)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    # address="local": a cluster of our own, even if `ray start` runs one on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run(coro):
    return asyncio.run(coro)


def ctx_completed(stats: dict) -> int:
    """Handoffs the CTX coordinators decided completed (recorded once every
    rank applied the decision: after the release a rank reports)."""
    return sum(c["decided"].get("completed", 0) for name, c in stats["coordinators"].items() if name.startswith("ctx"))


async def settled(fleet: Fleet, ready=lambda stats: True, timeout: float = TIMEOUT) -> dict:
    """Fleet stats once no rank holds a lease, no coordinator a parent in
    flight, and `ready(stats)` (bounded: an L1 limit, not a pace)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await fleet.stats()
        idle = all("error" not in s and s["leased"] == 0 for s in stats["ranks"]) and all(
            c.get("in_flight") == 0 for c in stats["coordinators"].values()
        )
        if (idle and ready(stats)) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


def ids(fleet: Fleet) -> dict[str, str]:
    return {i["id"]: i["instance_id"] for i in fleet.instances()}


async def learned(fleet: Fleet, gens: list[str], direct: list[str], timeout: float = TIMEOUT) -> None:
    """Warm every pair of `gens` with the CTX instances (one handoff each),
    then wait until each GEN coordinator knows which of them admit at the
    OPEN (`direct`): it asks once per pair, answered while the first handoff
    runs."""
    ctxs = [i["id"] for i in fleet.instances() if i["role"] == "ctx"]
    warm = await asyncio.gather(
        *(fleet.handoff(f"warm-{c}-{g}", TOKENS, ctx=c, gen=g, timeout=timeout) for c in ctxs for g in gens)
    )
    assert all(r.outcome == "completed" for r in warm), warm
    want = sorted(ids(fleet)[c] for c in direct)
    deadline = time.monotonic() + timeout
    for g in gens:
        while (await fleet.coordinator_of(g).stats.remote())["peers_admitting_at_open"] != want:
            assert time.monotonic() < deadline, await fleet.coordinator_of(g).stats.remote()
            await asyncio.sleep(0.02)


def counter(stats: dict, instance: str, key: str) -> int:
    return sum(s["counters"].get(key, 0) for s in stats["ranks"] if s["instance"] == instance)


def coord_calls(stats: dict, instance: str, key: str) -> int:
    return stats["coordinators"][instance]["calls"].get(key, 0)


def test_every_pair_of_a_mixed_fleet_one_rank_ctx_admitted_at_its_opens_the_other_in_rounds() -> None:
    async def scenario():
        fleet = await Fleet.launch(ctx=[1, 2], gen=[1, 2], pool_blocks=32, **FLEET)
        try:
            await learned(fleet, ["gen0", "gen1"], direct=["ctx0"])
            before = await fleet.stats()
            pairs = [(c, g) for c in ("ctx0", "ctx1") for g in ("gen0", "gen1")]
            results = await asyncio.gather(
                *(fleet.handoff(f"p{i}-{c}-{g}", TOKENS, ctx=c, gen=g, timeout=TIMEOUT) for i in range(2) for c, g in pairs)
            )
            middle = await fleet.stats()
            # One more on its own: gen0 is idle, so it admits it alone.
            results.append(await fleet.handoff("lone", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT))
            # The CTX coordinators heard of ctx0's handoffs only in a report:
            # they must still end all 13 (4 warm, 9 here; L1).
            return results, before, middle, await settled(fleet, lambda stats: ctx_completed(stats) == 13)
        finally:
            await fleet.shutdown()

    results, before, middle, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 9, results
    expected = 3 * (LAYOUT.num_layers * 2 * LAYOUT.num_kv_heads * LAYOUT.tokens_per_block * LAYOUT.head_dim * 2)
    assert all(r.bytes_verified == expected for r in results), results
    # ctx0 (tp=1): 5 handoffs, every one admitted at its OPEN, no vote round there.
    assert counter(stats, "ctx0", "admitted_at_open") - counter(before, "ctx0", "admitted_at_open") == 5, stats["ranks"]
    assert coord_calls(stats, "ctx0", "rank_vote_calls") == coord_calls(before, "ctx0", "rank_vote_calls")
    # ctx1 (tp=2): admitted in its rounds, at no OPEN.
    assert counter(stats, "ctx1", "admitted_at_open") == 0
    assert coord_calls(stats, "ctx1", "rank_vote_calls") > coord_calls(before, "ctx1", "rank_vote_calls")
    assert stats["coordinators"]["ctx0"]["admits_at_open"] and not stats["coordinators"]["ctx1"]["admits_at_open"]
    # gen0 (tp=1) admits with ctx0 alone while idle (of the burst, at most
    # the two with ctx0; busy, it batches), the lone one alone; gen1 (tp=2)
    # never: rounds.
    assert counter(middle, "gen0", "admitted_alone") - counter(before, "gen0", "admitted_alone") <= 2, middle["ranks"]
    assert counter(stats, "gen0", "admitted_alone") - counter(middle, "gen0", "admitted_alone") == 1, stats["ranks"]
    assert counter(stats, "gen1", "admitted_alone") == 0
    assert stats["coordinators"]["gen0"]["admits_alone"] and not stats["coordinators"]["gen1"]["admits_alone"]
    # The GEN coordinators asked ctx1 to admit its 4, ctx0 none of its 4:
    # fewer peer admission calls than handoffs paired with a round.
    asked = sum(coord_calls(stats, g, "peer_admit_calls") - coord_calls(before, g, "peer_admit_calls") for g in ("gen0", "gen1"))
    assert 1 <= asked <= 4, asked
    assert ctx_completed(stats) == 13, [c["decided"] for c in stats["coordinators"].values()]
    assert_clean(stats)


def _keep_refused_opens(ep) -> None:
    """Inside a CTX rank: keep a copy of every OPEN frame it refuses."""
    from kvhandoff.protocol import Open, encode_frame

    kept: list[bytes] = []
    refused = ep._refused

    def keeping(message, exc, version):
        if isinstance(message, Open):
            kept.append(encode_frame(message))
        return refused(message, exc, version)

    ep._refused = keeping
    ep.kept_refused_opens = kept


def test_a_ctx_rank_without_room_refuses_the_open_and_the_handoff_ends_cleanly() -> None:
    """Pools of 4 blocks, handoffs of 3: the first holds 3 CTX blocks while
    its chunks are held in flight; the second, from the other GEN instance,
    finds 1 free block at its OPEN: a REJECT (the GEN rank's NOT_STARTED
    evidence) ends it unserved and its GEN blocks come back."""

    async def scenario():
        fleet = await Fleet.launch(ctx=1, gen=2, pool_blocks=4, fault_plan=FaultPlan(hold=True), **FLEET)
        try:
            ctx = (await fleet.instance_ranks("ctx0"))[0]
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            for g in ("gen0", "gen1"):  # one at a time: a pool holds one handoff
                await learned(fleet, [g], direct=["ctx0"])
                # A completed handoff's CTX blocks come back at the decision's
                # apply, after the client's answer: the next warm handoff's
                # OPEN must find them free.
                assert all(s["leased"] == 0 for s in (await settled(fleet))["ranks"])
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", True))
            before = await ctx.stats.remote()
            held = asyncio.create_task(fleet.handoff("held", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT))
            deadline = time.monotonic() + TIMEOUT
            while (await ctx.stats.remote())["in_flight_chunks"] == 0:
                assert time.monotonic() < deadline and not held.done()
                await asyncio.sleep(0.02)
            await inside(ctx, _keep_refused_opens)
            refused = await fleet.handoff("refused", TOKENS, ctx="ctx0", gen="gen1", timeout=TIMEOUT)
            during = await ctx.stats.remote()
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            held = await held
            await settled(fleet)
            # The refused OPEN again, now that the pool has room: refused too.
            (copy,) = await inside(ctx, lambda ep: ep.kept_refused_opens)
            again = await ctx.receive_frame.remote(copy)
            return held, refused, before, during, again, await settled(fleet)
        finally:
            await fleet.shutdown()

    held, refused, before, during, again, stats = run(scenario())
    assert held.outcome == "completed", held
    # Refused by the CTX, as a round refuses it: "rejected", not "cancelled".
    assert refused.outcome == "rejected" and refused.bytes_verified == 0, refused
    assert refused.gen_outcomes == ("rejected",) and refused.ctx_outcomes == ("none",), refused
    c0, c1 = before["counters"], during["counters"]
    assert c1.get("refused_NoCapacity", 0) > c0.get("refused_NoCapacity", 0), c1
    assert c1.get("frames_reject", 0) > c0.get("frames_reject", 0), c1
    assert during["leased"] == 3, during  # the held handoff's blocks only
    ctx_rank = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx_rank["counters"].get("admitted_at_open", 0) == c0.get("admitted_at_open", 0) + 1, ctx_rank["counters"]
    # The copy: refused as a ticket refused before, never admitted (S1).
    assert again is False
    assert ctx_rank["counters"].get("refused_StaleError", 0) == c1.get("refused_StaleError", 0) + 1, ctx_rank["counters"]
    assert_clean(stats)


def test_a_draining_ctx_rank_refuses_an_open_and_its_drain_waits_for_what_it_admitted() -> None:
    async def scenario():
        fleet = await Fleet.launch(ctx=1, gen=1, pool_blocks=16, fault_plan=FaultPlan(hold=True), **FLEET)
        try:
            ctx = (await fleet.instance_ranks("ctx0"))[0]
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            await learned(fleet, ["gen0"], direct=["ctx0"])
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", True))
            held = asyncio.create_task(fleet.handoff("held", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT))
            deadline = time.monotonic() + TIMEOUT
            while (await ctx.stats.remote())["in_flight_chunks"] == 0:
                assert time.monotonic() < deadline and not held.done()
                await asyncio.sleep(0.02)
            coord = fleet.coordinator_of("ctx0")
            # Its rank admitted "held" at the OPEN and reported nothing yet:
            # the drain learns of it from the rank's answer and waits.
            early = await coord.drain.remote(0.5)
            # A handoff that reaches the rank anyway (a GEN coordinator asked
            # directly, past the fleet's routing) is refused at its OPEN.
            late = await fleet.coordinator_of("gen0").submit.remote(
                ParentKey(request_id="late", ctx_attempt=1, gen_attempt=1), TOKENS, True, (), ids(fleet)["ctx0"]
            )
            during = await ctx.stats.remote()
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            result = await held
            drained = await coord.drain.remote(TIMEOUT)
            return early, late, during, result, drained, await settled(fleet)
        finally:
            await fleet.shutdown()

    early, late, during, held, drained, stats = run(scenario())
    assert early is False, "the drain did not wait for the handoff its rank admitted at the OPEN"
    assert late == "cancelled", late  # the GEN coordinator's decision; a client sees "rejected" (the no-room test)
    assert during["counters"].get("refused_at_open_draining", 0) >= 1, during["counters"]
    assert during["counters"].get("admitted_at_open", 0) == 1, during["counters"]  # held (warm: in a round)
    assert held.outcome == "completed" and drained is True, (held, drained)
    assert_clean(stats)


def test_a_rank_not_taken_into_its_coordinators_rounds_admits_nothing_at_an_open() -> None:
    """A CTX rank admits at the OPEN only once its coordinator joined it (at
    start, or after a restart): one that was not refuses, and the handoff
    ends unserved with nothing held; joined again, it serves."""

    async def scenario():
        fleet = await Fleet.launch(ctx=1, gen=1, pool_blocks=16, **FLEET)
        try:
            ctx = (await fleet.instance_ranks("ctx0"))[0]
            await learned(fleet, ["gen0"], direct=["ctx0"])
            # Joined at start by its coordinator: it admits at the OPEN.
            first = await fleet.handoff("first", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT)
            await inside(ctx, lambda ep: setattr(ep.member, "joined", False))
            unjoined = await fleet.handoff("unjoined", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT)
            during = await ctx.stats.remote()
            await inside(ctx, lambda ep: setattr(ep.member, "joined", True))
            after = await fleet.handoff("after", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT)
            return first, unjoined, during, after, await settled(fleet)
        finally:
            await fleet.shutdown()

    first, unjoined, during, after, stats = run(scenario())
    assert first.outcome == "completed", first
    assert unjoined.outcome == "rejected" and unjoined.bytes_verified == 0, unjoined
    assert during["counters"].get("refused_at_open_not_joined", 0) == 1, during["counters"]
    assert during["counters"].get("admitted_at_open", 0) == 1, during["counters"]  # "first"
    assert during["leased"] == 0, during
    assert after.outcome == "completed", after
    assert_clean(stats)


def test_the_path_turns_off_and_a_bad_value_is_refused_before_anything_starts() -> None:
    async def scenario():
        with pytest.raises(InvalidConfig, match="admit_at_open"):
            await Fleet.launch(ctx=1, gen=1, pool_blocks=8, admit_at_open="yes", **FLEET)
        fleet = await Fleet.launch(ctx=1, gen=1, pool_blocks=8, admit_at_open=False, **FLEET)
        try:
            results = [await fleet.handoff(f"off{i}", TOKENS, timeout=TIMEOUT) for i in range(2)]
            return results, [i["id"] for i in fleet.instances()], await settled(fleet)
        finally:
            await fleet.shutdown()

    results, names, stats = run(scenario())
    assert names == ["ctx0", "gen0"]
    assert [r.outcome for r in results] == ["completed"] * 2, results
    assert not stats["coordinators"]["ctx0"]["admits_at_open"]
    assert stats["coordinators"]["gen0"]["peers_admitting_at_open"] == []
    assert stats["coordinators"]["gen0"]["calls"].get("peer_admit_calls", 0) == 2
    assert counter(stats, "ctx0", "admitted_at_open") == 0
    assert_clean(stats)


def test_a_pair_deployment_admits_at_the_open_by_default_and_a_cancel_mid_transfer_ends_cleanly() -> None:
    """A `Deployment` of a one-rank CTX instance admits at the OPEN by
    default (explicit True needs ctx_tp=1; a bad value is refused): after
    the first handoff (admitted in a round while the GEN coordinator asks),
    the CTX rank admits at the OPEN; a client cancel of a handoff whose
    chunks are held in flight ends it "cancelled" with every pool whole."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import settled_stats

    async def scenario():
        with pytest.raises(InvalidConfig, match="ctx_tp=1"):
            await Deployment.launch(ctx_tp=2, gen_tp=1, admit_at_open=True, **FLEET)
        with pytest.raises(InvalidConfig, match="admit_at_open"):
            await Deployment.launch(ctx_tp=1, gen_tp=1, admit_at_open=1, **FLEET)
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=16, fault_plan=FaultPlan(hold=True), **FLEET)
        try:
            (ctx,) = await dep.ranks(Role.CTX)
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            results = [await dep.handoff(f"d{i}", TOKENS, timeout=TIMEOUT) for i in range(3)]
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", True))
            held = asyncio.create_task(dep.handoff("held", TOKENS, timeout=TIMEOUT))
            deadline = time.monotonic() + TIMEOUT
            while (await ctx.stats.remote())["in_flight_chunks"] == 0:
                assert time.monotonic() < deadline and not held.done()
                await asyncio.sleep(0.02)
            await dep.cancel("held")
            await inside(ctx, lambda ep: setattr(ep.transport.plan, "hold", False))
            return results, await held, await ctx.stats.remote(), await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    results, held, ctx, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 3, results
    assert held.outcome == "cancelled", held
    assert ctx["counters"].get("admitted_at_open", 0) >= 3, ctx["counters"]  # d1, d2 and held at least
    assert_clean(stats)


def test_a_lone_handoff_between_one_rank_instances_goes_to_the_gen_rank_and_refuses_without_room() -> None:
    """With a CTX peer that admits at the OPEN and no client channel (Ray
    frames: with stream frames the channel takes it, the next test), a pair
    deployment's lone handoff between instances of one rank each is one
    call to the GEN rank (`receive_alone`): it admits, sends the OPEN, completes alone and
    answers, with no coordinator on the path (its coordinator learns of it
    from the rank's report). The traced path is receive_alone, OPEN,
    TERMINAL, the answer: no vote, no admission alone, no decision. With a
    finished handoff's blocks kept for its consumer (submitted to the
    coordinator, which admits it alone), the next one finds too few free
    GEN blocks: the rank refuses it, "rejected", nothing held; every pool
    is whole at the end."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import settled_stats

    async def scenario():
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=4, control_frames="ray", **FLEET)
        try:
            (ctx,), (gen,) = await dep.ranks(Role.CTX), await dep.ranks(Role.GEN)
            await dep.set_trace(1)
            results, traces = [], []
            for i in range(4):
                results.append(await dep.handoff(f"a{i}", TOKENS, timeout=TIMEOUT))
                traces.append(await dep.trace(f"a{i}"))
                deadline = time.monotonic() + TIMEOUT
                # A pool holds one handoff: the next one's OPEN must find the
                # CTX rank whole (it releases at the RECEIPT, after the answer).
                while (await ctx.stats.remote())["free"] != 4:
                    assert time.monotonic() < deadline, "the CTX rank never released its blocks"
                    await asyncio.sleep(0.01)
            at_rank = dep.calls["receive_at_rank"]
            # A handoff kept for its consumer holds 3 of the GEN rank's 4
            # blocks once it is over; the next one goes to the rank, which
            # refuses it for want of room.
            coordinator = dep.coordinator(Role.GEN)
            kept = ParentKey(request_id="kept", ctx_attempt=1000, gen_attempt=1000)
            held = await coordinator.submit.remote(kept, TOKENS, False)
            refused = await dep.handoff("refused", TOKENS, timeout=TIMEOUT)
            went_to_rank = dep.calls["receive_at_rank"] - at_rank
            during = await gen.stats.remote()
            await gen.free.remote(kept)
            return results, traces, at_rank, held, (refused, went_to_rank), during, await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    results, traces, at_rank, held, refused, during, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 4, results
    assert at_rank == 4, at_rank
    assert all(t is not None for t in traces)
    fastest = min(traces, key=lambda t: t.hops)
    steps = [h.what for h in fastest.path]
    assert fastest.hops <= 4 and "receive_alone" in steps, fastest.path
    assert not {"round_vote", "admit_alone", "report"} & set(steps), fastest.path
    # The rank marks its answer: the client's outcome follows that mark,
    # whatever reached the rank or its coordinator after it (a lazy report).
    assert [h.what for h in fastest.path][-2:] == ["sent:outcome", "outcome"], fastest.path
    assert fastest.path[-2].actor.startswith("rank0@"), fastest.path
    assert held == "completed", held
    refused, went_to_rank = refused
    assert refused.outcome == "rejected" and refused.bytes_verified == 0, refused
    assert went_to_rank == 1, went_to_rank  # refused by the rank, not in a round
    assert during["leased"] == 3, during  # the kept handoff's blocks only
    assert during["counters"].get("received_alone_refused", 0) >= 1, during["counters"]
    gen = next(s for s in stats["ranks"] if s["role"] == "gen")
    assert gen["counters"].get("received_alone", 0) >= 4, gen["counters"]
    # Each answered by the rank: its completion report waited (lazy) instead
    # of going out ahead of that answer (a hop on the path).
    assert gen["counters"].get("completion_reports_lazy", 0) >= 4, gen["counters"]
    decided = stats["coordinators"]["gen"]["decided"]
    assert decided.get("admitted", 0) <= 1, decided  # the kept one at most: a coordinator's submission
    assert decided.get("completed", 0) >= 4, decided  # it took each in flight from the report
    assert_clean(stats)


def test_a_lone_handoff_takes_the_client_channel_once_it_is_open() -> None:
    """With stream frames, the first lone handoff goes to the GEN rank (as
    above) while the client's channel to the GEN coordinator opens; every
    later one is a message on that channel, admitted alone by the
    coordinator (its call to the rank on the rank's channel) and answered
    on the channel. Once the coordinator learned that its peer admits at
    the OPEN (its first round with it), no Ray call is on the path: six
    sequential hops at most
    (a message costs less than a Ray call: docs/design.md "Submissions in
    batches"), every byte verified, every pool whole."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import assert_clean, settled_stats

    async def scenario():
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=8, **FLEET)
        try:
            await dep.set_trace(1)
            first = await dep.handoff("ch0", TOKENS, timeout=TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while not dep._submitter.has_channel(dep.coordinator(Role.GEN)):
                assert time.monotonic() < deadline, "the client's channel never opened"
                await asyncio.sleep(0.01)
            results, traces = [], []
            for i in range(1, 6):  # the first two teach the coordinator how its peer admits
                results.append(await dep.handoff(f"ch{i}", TOKENS, timeout=TIMEOUT))
                traces.append(await dep.trace(f"ch{i}"))
            return first, results, traces, dict(dep.calls), dict(dep._submitter.counters), await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    first, results, traces, calls, submits, stats = run(scenario())
    assert first.outcome == "completed" and [r.outcome for r in results] == ["completed"] * 5, (first, results)
    assert all(r.bytes_verified == results[0].bytes_verified > 0 for r in results), results
    assert calls["receive_at_rank"] == 1, calls  # the first one only
    assert submits["submit_channel"] == 5 and submits["submit_calls"] == submits["submit_batches"] == 0, submits
    coord = stats["coordinators"]["gen"]["calls"]
    assert coord["submit_by_channel"] == 5, coord
    # Admitted alone (or in a round, when a report kept the coordinator
    # busy): the rank's calls on its channel either way.
    assert coord.get("admit_alone_by_channel", 0) >= 1 and not coord.get("admit_alone_by_ray"), coord
    for trace in traces[2:]:
        assert trace is not None and trace.hops <= 6, "\n".join(f"{e.actor} {e.what} {e.carrier} {e.since_prev_ms:.2f}" for e in trace.path)
        assert "receive_alone" not in [h.what for h in trace.path], trace.path
    assert_clean(stats)


def test_a_lone_handoffs_open_leaves_before_the_gen_ranks_report() -> None:
    """A receive at the GEN rank pushes its report to the coordinator and
    sends its OPEN in the same event-loop turn. The OPEN is on the
    handoff's critical path and the report is not, and the report's Ray
    call costs the loop a few hundred µs: the rank flushes its urgent
    frames first. Watched on the real GEN rank: no report went out while a
    frame waited in the rank's outbox."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.cli.harness import _reports_with_frames_waiting, _watch_reports, on_endpoint_loop
    from kvhandoff.protocol import Role

    async def scenario() -> tuple[list[str], list[bool], int]:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=8, control_frames="ray", **FLEET)
        try:
            (gen,) = await dep.ranks(Role.GEN)
            await gen.__ray_call__.remote(on_endpoint_loop, _watch_reports)
            outcomes = [(await dep.handoff(f"lone{i}", TOKENS, timeout=TIMEOUT)).outcome for i in range(3)]
            waiting = await gen.__ray_call__.remote(on_endpoint_loop, _reports_with_frames_waiting)
            return outcomes, waiting, dep.calls["receive_at_rank"]
        finally:
            await dep.shutdown()

    outcomes, waiting, at_rank = run(scenario())
    assert outcomes == ["completed"] * 3 and at_rank == 3, (outcomes, at_rank)
    assert len(waiting) >= 3, waiting  # one report per receive at least
    assert not any(waiting), waiting


def test_a_fleets_one_rank_gen_instance_admits_alone_in_six_hops_and_refuses_without_room() -> None:
    """A fleet's submissions go through the GEN coordinator (it names the
    CTX instance): with a CTX peer that admits at the OPEN, its one-rank GEN
    instance admits with no round: the coordinator hands the submission to
    the rank (`admit_alone`), and the rank's answer brings its report, so
    the leader has the parent in flight before anything else. After the
    first handoff (admitted in a round while the GEN coordinator learns how
    the peer admits), the traced path is submit, admit_alone, OPEN,
    TERMINAL, report, outcome: 6 hops, no vote. With a finished handoff's
    blocks kept for its consumer, the next one finds too few free GEN
    blocks: the rank refuses it alone, "rejected", nothing held; every pool
    is whole at the end."""

    async def scenario():
        fleet = await Fleet.launch(ctx=1, gen=1, pool_blocks=4, **FLEET)
        try:
            (ctx,), (gen,) = await fleet.instance_ranks("ctx0"), await fleet.instance_ranks("gen0")
            await fleet.set_trace(1)
            results, traces = [], []
            for i in range(4):
                results.append(await fleet.handoff(f"a{i}", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT))
                traces.append(await fleet.trace(f"a{i}"))
                deadline = time.monotonic() + TIMEOUT
                # A pool holds one handoff: the next one's OPEN must find the
                # CTX rank whole (it releases at the RECEIPT, after the answer).
                while (await ctx.stats.remote())["free"] != 4:
                    assert time.monotonic() < deadline, "the CTX rank never released its blocks"
                    await asyncio.sleep(0.01)
            # A handoff kept for its consumer holds 3 of the GEN rank's 4
            # blocks once it is over: the coordinator is idle, so the next
            # one goes alone, and the rank refuses it for want of room.
            coordinator = fleet.coordinator_of("gen0")
            kept = ParentKey(request_id="kept", ctx_attempt=1000, gen_attempt=1000)
            held = await coordinator.submit.remote(kept, TOKENS, False, (), ids(fleet)["ctx0"])
            before = (await coordinator.stats.remote())["calls"].get("rank_admit_alone", 0)
            refused = await fleet.handoff("refused", TOKENS, ctx="ctx0", gen="gen0", timeout=TIMEOUT)
            went_alone = (await coordinator.stats.remote())["calls"].get("rank_admit_alone", 0) - before
            during = await gen.stats.remote()
            await gen.free.remote(kept)
            return results, traces, held, (refused, went_alone), during, await settled(fleet)
        finally:
            await fleet.shutdown()

    results, traces, held, refused, during, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 4, results
    assert all(t is not None for t in traces)
    alone = min(traces[1:], key=lambda t: t.hops)  # a report can race one hop longer on a busy box
    steps = [h.what for h in alone.path]
    assert alone.hops <= 6 and "admit_alone" in steps and "round_vote" not in steps, alone.path
    assert held == "completed", held
    refused, went_alone = refused
    assert refused.outcome == "rejected" and refused.bytes_verified == 0, refused
    assert went_alone == 1, went_alone  # refused by the rank alone, not in a round
    assert during["leased"] == 3, during  # the kept handoff's blocks only
    assert during["counters"].get("admit_refused", 0) >= 1, during["counters"]
    gen = next(s for s in stats["ranks"] if s["role"] == "gen")
    assert gen["counters"].get("admitted_alone", 0) >= 4, gen["counters"]  # a1-a3 and held at least
    decided = stats["coordinators"]["gen0"]["decided"]
    assert decided.get("admitted", 0) <= 1, decided  # in a round: the first handoff at most
    assert_clean(stats)


def test_a_cancel_right_after_an_admission_alone_is_decided_by_the_gen_coordinator() -> None:
    """The rank's answer to `admit_alone` brings the admission to the GEN
    coordinator's leader: a cancel sent to that coordinator next (and
    nowhere else) is decided "cancelled" even though the rank has sent
    nothing yet (its OPEN is held back: no report, no frame), and the
    handoff never runs. Were the leader to learn of the parent only from a
    later report, it would drop the cancel (default-deny: `cancel` answers
    None) and the handoff would complete."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.cli.harness import _defer_opens, _deferred, _run_deferred, on_endpoint_loop
    from kvhandoff.protocol import Role

    from .helpers import settled_stats

    async def scenario():
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=16, **FLEET)
        try:
            (gen,) = await dep.ranks(Role.GEN)
            coordinator = dep.coordinator(Role.GEN)
            # A first submission through the coordinator (a lone handoff
            # would go to the GEN rank): it learns how the peer admits.
            first = ParentKey(request_id="first", ctx_attempt=999, gen_attempt=999)
            assert await coordinator.submit.remote(first, TOKENS, True) == "completed"
            await gen.__ray_call__.remote(on_endpoint_loop, _defer_opens, "alone")
            parent = ParentKey(request_id="alone", ctx_attempt=1000, gen_attempt=1000)
            submitted = coordinator.submit.remote(parent, TOKENS, True)
            deadline = time.monotonic() + TIMEOUT
            while not await gen.__ray_call__.remote(on_endpoint_loop, _deferred, "alone"):
                assert time.monotonic() < deadline, "the GEN rank never admitted it"
                await asyncio.sleep(0.01)
            cancelled = await coordinator.cancel.remote(parent)
            await gen.__ray_call__.remote(on_endpoint_loop, _run_deferred, "alone")
            calls = (await coordinator.stats.remote())["calls"]
            return cancelled, await submitted, calls, await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    cancelled, outcome, calls, stats = run(scenario())
    assert calls.get("rank_admit_alone", 0) >= 1, calls
    assert cancelled == "cancelled" and outcome == "cancelled", (cancelled, outcome)
    assert_clean(stats)


def test_a_busy_gen_instance_batches_in_rounds_and_a_lone_handoff_goes_alone() -> None:
    """Admission alone is for an idle GEN coordinator only: sixteen
    handoffs submitted at once find it busy (a round running, admissions
    queued, an admission alone out), so most join one round that admits
    them together, one call per rank; a lone handoff afterwards goes to the
    GEN rank itself. Were every submission admitted alone, a busy instance would pay
    one rank call and one frame call per handoff (the GPU host lost a third
    of a pair's rate so)."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import settled_stats

    burst = 16

    async def scenario():
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=64, control_frames="ray", **FLEET)
        try:
            coordinator = dep.coordinator(Role.GEN)
            assert (await dep.handoff("warm", TOKENS, timeout=TIMEOUT)).outcome == "completed"
            before = await coordinator.stats.remote()
            results = await asyncio.gather(*(dep.handoff(f"b{i}", TOKENS, timeout=TIMEOUT) for i in range(burst)))
            middle = await coordinator.stats.remote()
            at_rank = dep.calls["receive_at_rank"]
            lone = await dep.handoff("lone", TOKENS, timeout=TIMEOUT)
            after = await coordinator.stats.remote()
            after["calls"]["receive_at_rank"] = dep.calls["receive_at_rank"] - at_rank
            return before, results, middle, lone, after, await settled_stats(dep, timeout=TIMEOUT)
        finally:
            await dep.shutdown()

    before, results, middle, lone, after, stats = run(scenario())
    assert [r.outcome for r in results] == ["completed"] * burst, results
    assert lone.outcome == "completed", lone

    def delta(a: dict, b: dict, key: str) -> int:
        return b["calls"].get(key, 0) - a["calls"].get(key, 0)

    alone = delta(before, middle, "rank_admit_alone")
    in_rounds = middle["decided"].get("admitted", 0) - before["decided"].get("admitted", 0)
    assert alone + in_rounds == burst, (alone, in_rounds)
    assert alone < burst // 2 and in_rounds > burst // 2, (alone, in_rounds)
    # A lone handoff goes to the GEN rank itself (the client has no other live).
    assert after["calls"]["receive_at_rank"] == 1 and delta(middle, after, "rank_admit_alone") == 0, after["calls"]
    assert_clean(stats)
