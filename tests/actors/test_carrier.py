"""`control_frames="auto"`: the control-frame carrier is measured once per
host at launch (actors/_carrier.py), reaches every rank of a deployment or
fleet (instances that join later included), and is reported by `stats()`
(also for the default, Ray calls, as asked).

The probe runs on real Ray actors with real NIXL agents. Which carrier a
host *should* take depends on the host, so the launch tests set the
launcher's per-node answer (the cache `choose_carrier` fills) and check
that the ranks then carry their frames on exactly that carrier."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import ray

from kvhandoff.actors import Deployment, InvalidConfig, _carrier
from kvhandoff.actors._carrier import (
    MIN_CORES,
    NIXL_MARGIN,
    PROBE_ROUNDS,
    CarrierChoice,
    choose_carrier,
    decide,
)
from kvhandoff.actors.fleet import Fleet
from kvhandoff.protocol import Role

from .helpers import BOUND_S, assert_clean, gen_bytes, inside, settled_stats, wait_stats

pytestmark = pytest.mark.ray

MS = 1e-3


# ---- the rule (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ray_ms", "notif_ms", "want"),
    [
        (1.2, 0.03, "nixl"),  # a many-core host: a notification hop is ~40x cheaper
        (1.0, NIXL_MARGIN * 1.0, "nixl"),  # exactly at the margin
        (1.0, NIXL_MARGIN * 1.0 + 0.01, "ray"),  # just over it: not a clear win
        (1.0, 11.9, "ray"),  # two cores: the pollers starve
    ],
)
def test_nixl_frames_only_by_a_clear_margin(ray_ms: float, notif_ms: float, want: str) -> None:
    carrier, why = decide([ray_ms * MS] * PROBE_ROUNDS, [notif_ms * MS] * PROBE_ROUNDS)
    assert carrier == want, why
    assert "us" in why  # it says what it measured


def test_a_lost_notification_or_no_ray_timing_keeps_ray_calls() -> None:
    fast = [0.01 * MS] * PROBE_ROUNDS
    carrier, why = decide([1 * MS] * PROBE_ROUNDS, fast[:-1])  # one notification never came back
    assert carrier == "ray" and "came back" in why
    assert decide([], fast)[0] == "ray"


# ---- choosing on a real cluster ----------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> dict[str, CarrierChoice]:
    """An empty per-node cache for this test (so it measures or decides anew)."""
    cache: dict[str, CarrierChoice] = {}
    monkeypatch.setattr(_carrier, "_CHOSEN", cache)
    return cache


def _node() -> str:
    return ray.get_runtime_context().get_node_id()


def test_asked_carriers_are_taken_as_asked(ray_cluster: Any, fresh: dict) -> None:
    for asked in ("ray", "nixl", "stream"):
        choice = asyncio.run(choose_carrier(asked))
        assert (choice.carrier, choice.asked, choice.why) == (asked, asked, "asked for")
    assert fresh == {}  # nothing measured, nothing cached


def test_few_cores_take_ray_calls_without_probing(ray_cluster: Any, fresh: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_probe(*_: Any, **__: Any) -> Any:
        raise AssertionError("a host with too few cores must not start the probe")

    monkeypatch.setattr(_carrier, "_cores", lambda: MIN_CORES - 1)
    monkeypatch.setattr(_carrier, "probe_carriers", no_probe)
    choice = asyncio.run(choose_carrier("auto"))
    assert choice.carrier == "ray" and "cores" in choice.why, choice
    assert choice.ray_rtt_us is None and fresh[_node()] is choice


def test_many_cores_probe_once_per_node_on_real_nixl_agents(
    ray_cluster: Any, fresh: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe times both carriers between two real actors with real NIXL
    agents; the choice follows the rule from those numbers; a second launch
    on the node reuses it (one probe per node and process)."""
    runs: list[tuple[list[float], list[float]]] = []
    real = _carrier.probe_carriers

    async def counted(node: str, **kw: Any) -> tuple[list[float], list[float]]:
        runs.append(await real(node, **kw))
        return runs[-1]

    monkeypatch.setattr(_carrier, "_cores", lambda: MIN_CORES)
    monkeypatch.setattr(_carrier, "probe_carriers", counted)
    first = asyncio.run(choose_carrier("auto"))
    again = asyncio.run(choose_carrier("auto"))
    assert len(runs) == 1 and again is first
    ray_rtts, notif_rtts = runs[0]
    assert len(ray_rtts) == PROBE_ROUNDS and all(t > 0 for t in ray_rtts)
    assert len(notif_rtts) == PROBE_ROUNDS and all(t > 0 for t in notif_rtts)  # every notification answered
    assert first.carrier == decide(ray_rtts, notif_rtts)[0], first
    assert first.ray_rtt_us and first.notif_rtt_us


def test_a_probe_that_fails_keeps_ray_calls(ray_cluster: Any, fresh: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("no UCX here")

    monkeypatch.setattr(_carrier, "_cores", lambda: 64)
    monkeypatch.setattr(_carrier, "probe_carriers", broken)
    choice = asyncio.run(choose_carrier("auto"))
    assert choice.carrier == "ray" and "RuntimeError" in choice.why, choice


def test_the_default_is_streams_as_asked(ray_cluster: Any, fresh: dict) -> None:
    """Without `control_frames` a deployment carries frames on TCP streams
    (actors/_stream.py) and measures nothing: not one frame rides a Ray call
    or a notification (docs/design.md "Control frames")."""
    fresh[_node()] = CarrierChoice("nixl", "auto", "what auto would take here", 16)

    async def scenario() -> dict:
        dep = await Deployment.launch(pool_blocks=16, chunk_bytes=64 << 10, round_timeout_s=20.0)
        try:
            assert (await dep.handoff("cr-default", 60, timeout=BOUND_S)).outcome == "completed"
            return await settled_stats(dep, BOUND_S)
        finally:
            await dep.shutdown()

    stats = asyncio.run(scenario())
    assert stats["control_frames"] == CarrierChoice("stream", "stream", "asked for", stats["control_frames"]["cores"]).as_dict()
    assert all(nixl == 0 and calls == 0 for _, nixl, calls in _frames_by_carrier(stats))
    for s in stats["ranks"]:
        assert s["frames"] == "stream" and s["counters"]["frames_stream_in"] > 0, s["counters"]


def test_an_unknown_carrier_is_refused_before_any_actor_starts(ray_cluster: Any, fresh: dict) -> None:
    with pytest.raises(InvalidConfig, match="auto"):
        asyncio.run(Deployment.launch(name="kvh-badcarrier", control_frames="udp"))
    assert fresh == {}


# ---- the choice reaches every rank --------------------------------------------------------


def _frames_by_carrier(stats: dict) -> list[tuple[int, int, int]]:
    """(frames sent, on notifications, Ray calls carrying frames) per rank."""
    return [
        (c["frames_sent"], c.get("frames_nixl", 0), c.get("frame_calls", 0))
        for c in (s["counters"] for s in stats["ranks"])
    ]


@pytest.mark.parametrize("carrier", ["nixl", "ray"])
def test_a_deployment_carries_its_frames_on_the_chosen_carrier(
    ray_cluster: Any, fresh: dict, carrier: str
) -> None:
    """An "auto" launch takes the node's answer: with "nixl" not one frame
    rides a Ray call, with "ray" not one rides a notification; either way
    every byte is verified and every pool comes back whole."""
    fresh[_node()] = CarrierChoice(carrier, "auto", "this test's answer", 16)

    async def scenario() -> tuple[list[Any], dict]:
        dep = await Deployment.launch(
            pool_blocks=32, chunk_bytes=64 << 10, round_timeout_s=20.0, control_frames="auto"
        )
        try:
            done = [await dep.handoff(f"cr-{carrier}-{i}", 100 + 40 * i, timeout=BOUND_S) for i in range(2)]
            return done, await settled_stats(dep, BOUND_S)
        finally:
            await dep.shutdown()

    done, stats = asyncio.run(scenario())
    for i, r in enumerate(done):
        assert r.outcome == "completed" and r.bytes_verified == gen_bytes(100 + 40 * i, 1), r
    assert_clean(stats)
    assert stats["control_frames"]["carrier"] == carrier
    for sent, nixl, calls in _frames_by_carrier(stats):
        assert sent > 0
        assert (nixl, calls == 0) == ((sent, True) if carrier == "nixl" else (0, False)), (sent, nixl, calls)


def test_an_instance_that_joins_a_fleet_takes_the_fleets_carrier(ray_cluster: Any, fresh: dict) -> None:
    """The fleet resolves "auto" once: an instance added later carries its
    frames on the same carrier as the first ones, whatever the node's cache
    says by then."""
    fresh[_node()] = CarrierChoice("nixl", "auto", "this test's answer", 16)

    async def scenario() -> tuple[Any, dict]:
        fleet = await Fleet.launch(
            ctx=1, gen=1, pool_blocks=32, chunk_bytes=64 << 10, round_timeout_s=20.0, control_frames="auto"
        )
        try:
            fresh[_node()] = CarrierChoice("ray", "auto", "changed after the launch", 16)
            joined = await fleet.add_instance("gen", tp=1)
            result = await fleet.handoff("cr-join", 120, gen=joined, timeout=BOUND_S)
            return result, await settled_stats(fleet, BOUND_S)
        finally:
            await fleet.shutdown()

    result, stats = asyncio.run(scenario())
    assert result.outcome == "completed" and result.gen_instance.startswith(f"{stats['name']}-gen1"), result
    assert stats["control_frames"]["carrier"] == "nixl"
    joined = [s for s in stats["ranks"] if s["instance"] == "gen1"]
    assert joined and all(c["frames_sent"] == c.get("frames_nixl", 0) > 0 for c in (s["counters"] for s in joined))


# ---- Ray calls: frames nothing waits for ride with the next one ----------------------------


def _configured(field: str, value: float) -> Any:
    """A function for `inside`: set one field of a rank's config, return its old value."""

    def apply(rank: Any) -> float:
        before = getattr(rank.config, field)
        rank.config = msgspec.structs.replace(rank.config, **{field: value})
        return before

    return apply


def _all_ended(stats: dict) -> bool:
    """Every block back in its pool, and both coordinators heard the handoff end."""
    pools = all(r["free"] == r["pool"] for r in stats["ranks"])
    return pools and all(c["in_flight"] == 0 for c in stats["coordinators"].values())


def _frame_counts(stats: dict) -> dict[str, dict[str, int]]:
    keys = ("frame_calls", "frames_ready", "frames_terminal", "frames_open", "frames_receipt")
    return {f'{s["role"]}{s["rank"]}': {k: s["counters"].get(k, 0) for k in keys} for s in stats["ranks"]}


def _receipts_after_release(stats: dict) -> int:
    return sum(s["counters"].get("receipts_after_release", 0) for s in stats["ranks"] if s["role"] == "ctx")


def test_ready_rides_with_the_terminal_and_a_lone_receipt_still_goes(ray_cluster: Any) -> None:
    """Over Ray calls a READY waits for the TERMINAL after it (one call
    carries both: nothing at the GEN acts before the TERMINAL), and a
    RECEIPT waits for the next OPEN to its CTX rank, or for the lazy
    flush. Here no OPEN follows: the RECEIPT still arrives, in a call of
    its own (after the CTX rank, alone in its instance, released the
    blocks at its TERMINAL: it counts a RECEIPT after the release); and
    the CTX rank's completion news, which waits the same way, still
    reaches its coordinator."""

    async def scenario() -> tuple[Any, dict, dict]:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=32, round_timeout_s=20.0, control_frames="ray")
        try:
            ranks = await dep.ranks(Role.CTX) + await dep.ranks(Role.GEN)
            for h in ranks:  # wide enough that only a frame's own flush can send it
                await inside(h, _configured("lazy_flush_s", 2.0))
            before = await settled_stats(dep, BOUND_S)
            result = await dep.handoff("lazy-0", 60, timeout=BOUND_S)
            after = await wait_stats(dep, lambda s: _all_ended(s) and _receipts_after_release(s) == 1, BOUND_S)
            return result, before, after
        finally:
            await dep.shutdown()

    result, before, after = asyncio.run(scenario())
    assert result.outcome == "completed" and result.bytes_verified == gen_bytes(60, 1), result
    assert_clean(after)
    assert _all_ended(after), after["coordinators"]
    assert _receipts_after_release(after) == 1, after["ranks"]
    b, a = _frame_counts(before), _frame_counts(after)
    sent = {rank: {k: a[rank][k] - b[rank][k] for k in a[rank]} for rank in a}
    assert sent["ctx0"] == {"frame_calls": 1, "frames_ready": 1, "frames_terminal": 1, "frames_open": 0, "frames_receipt": 0}, sent
    assert sent["gen0"] == {"frame_calls": 2, "frames_ready": 0, "frames_terminal": 0, "frames_open": 1, "frames_receipt": 1}, sent


def test_news_that_comes_within_the_gap_rides_in_the_next_report_and_is_never_lost(ray_cluster: Any) -> None:
    """A GEN rank that reported a moment ago holds its next report until the
    gap (`report_gap_s`) has passed: completions that come meanwhile go in
    one report. A fleet's GEN instance pairs with two CTX instances here, so
    the TERMINALs of a pair of handoffs come on two streams, each in a turn
    of the rank's loop of its own: some reports are held. Each handoff's
    answer waits for its coordinator to hear the completion, and every
    handoff still completes and is heard of (the coordinators end with
    nothing in flight): held news goes out when the gap ends."""
    rounds = 4

    async def scenario() -> tuple[list[Any], dict]:
        fleet = await Fleet.launch(ctx=2, gen=1, pool_blocks=32, round_timeout_s=20.0)
        try:
            (gen,) = await fleet.instance_ranks("gen0")
            # Wide, so that the completions of a pair of handoffs fall within
            # it; short next to the bound, so held reports do not slow the test.
            await inside(gen, _configured("report_gap_s", 0.25))
            results: list[Any] = []
            for i in range(rounds):
                results += await asyncio.gather(
                    *(fleet.handoff(f"gap-{i}-{c}", 60, ctx=c, gen="gen0", timeout=BOUND_S) for c in ("ctx0", "ctx1"))
                )
            return results, await wait_stats(fleet, _all_ended, BOUND_S)
        finally:
            await fleet.shutdown()

    results, stats = asyncio.run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 2 * rounds, results
    assert all(r.bytes_verified == gen_bytes(60, 1) for r in results), results
    assert_clean(stats)
    assert _all_ended(stats), stats["coordinators"]
    (gen,) = [s for s in stats["ranks"] if s["role"] == "gen"]
    assert gen["counters"].get("reports_paced", 0) >= 1, sorted(gen["counters"].items())


def _coordinator_lazy_apply(seconds: float) -> Any:
    """A function for a coordinator's `__ray_call__`: set its lazy-apply window."""

    def apply(coordinator: Any) -> float:
        before = coordinator._lazy_apply_s
        coordinator._lazy_apply_s = seconds
        return before

    return apply


@pytest.mark.parametrize("admit_at_open", [False, True], ids=["rides_with_a_vote", "rides_with_an_admission_alone"])
def test_blocks_a_riding_completion_returns_are_free_for_the_vote_it_rides_with(ray_cluster: Any, admit_at_open: bool) -> None:
    """A GEN rank returns a finished handoff's blocks nobody consumes after
    the completion's apply. When that apply rides inside the next round's
    vote call, they must be free before the vote: a GEN pool that holds one
    request at a time still admits the next one. Here the GEN coordinator's
    window is wide, so the completion surely waits for the next admission,
    and the CTX rank is seen whole before it comes (only the GEN's blocks
    are in question). A GEN rank that admits alone (no vote to ride with;
    a one-by-one fleet, whose submissions go through the GEN coordinator):
    the waiting apply rides with the admission alone instead, applied
    before it."""
    blocks = 4

    async def scenario() -> tuple[list[Any], dict]:
        common = dict(pool_blocks=blocks, round_timeout_s=120.0, control_frames="ray", admit_at_open=admit_at_open)
        dep: Any = await (Fleet.launch(ctx=1, gen=1, **common) if admit_at_open else Deployment.launch(ctx_tp=1, gen_tp=1, **common))
        try:
            gen_coordinator = dep.coordinator_of("gen0") if admit_at_open else dep.coordinator(Role.GEN)
            await gen_coordinator.__ray_call__.remote(_coordinator_lazy_apply(60.0))
            ctx = (await (dep.instance_ranks("ctx0") if admit_at_open else dep.ranks(Role.CTX)))[0]
            results = []
            for i in range(3):
                results.append(await dep.handoff(f"one-at-a-time-{i}", 16 * blocks, timeout=BOUND_S))
                deadline = time.monotonic() + BOUND_S
                while (await ctx.stats.remote())["free"] != blocks:  # the CTX rank released it
                    assert time.monotonic() < deadline, "the CTX rank never released its blocks"
                    await asyncio.sleep(0.01)
            calls = (await gen_coordinator.stats.remote())["calls"]
            return results, calls
        finally:
            await dep.shutdown()

    results, calls = asyncio.run(scenario())
    assert [r.outcome for r in results] == ["completed"] * 3, results
    if admit_at_open:
        assert calls.get("applies_delayed", 0) >= 2 and calls.get("rank_admit_alone", 0) >= 2, calls
        # ... each waiting apply rode with the next admission alone: no call of its own.
        assert calls.get("applies_carried", 0) >= 2, calls
    else:
        assert calls.get("applies_delayed", 0) >= 2 and calls.get("applies_carried", 0) >= 2, calls
