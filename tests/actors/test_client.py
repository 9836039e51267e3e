"""The client API (`Deployment`) against misuse, abandonment and dead parts,
on a real local Ray cluster with real rank actors and real NIXL on host memory.

Each test is a defect of issue 8 seen from the client: bad input refused at the
boundary (9, 10), abandoned attempts handed back (11), "completed" that never
lies and dead ranks as outcomes (13), launch that waits on progress and cleans
up (8, 14), stats and shutdown with dead parts (15), and the bounded attempt
map. Waits are on observable conditions (`until_idle`), with generous bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import ray

from kvhandoff.actors import (
    DEFAULT_LAYOUT,
    Deployment,
    DeploymentClosed,
    HandoffResult,
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
)
from kvhandoff.actors._coordinator_errors import CoordinatorError, ParentInFlight
from kvhandoff.actors._directory import _pid_alive
from kvhandoff.actors._submit import SubmitAnswer, SubmitRequest
from kvhandoff.cli.harness import (
    defer_opens,
    deferred_opens,
    held_frames,
    hold_frames,
    release_frames,
)
from kvhandoff.protocol import ParentKey, RecentMemory, Role, RoundError
from kvhandoff.topology import block_bytes

from .helpers import ROUND_TIMEOUT, TOKENS, inside, run, wait_stats

pytestmark = pytest.mark.ray

POOL = 128
TIMEOUT = 20.0
IDLE_BOUND = 60.0  # L1/L2: generous bound on giving every block back
OUTCOMES = {"completed", "cancelled", "rejected", "failed", "timeout"}


def expected_bytes(tokens: int, gen_tp: int) -> int:
    blocks = math.ceil(tokens / DEFAULT_LAYOUT.tokens_per_block)
    return blocks * block_bytes(DEFAULT_LAYOUT, gen_tp) * gen_tp


async def until_idle(dep: Deployment, bound: float = IDLE_BOUND) -> dict:
    """Stats once every answering rank holds no leased block; fails after `bound`."""
    deadline = time.monotonic() + bound
    while True:
        stats = await dep.stats()
        ranks = [s for s in stats["ranks"] if "error" not in s]
        if ranks and all(s["leased"] == 0 for s in ranks):
            return stats
        assert time.monotonic() < deadline, [(s.get("role"), s.get("leased"), s.get("parents")) for s in stats["ranks"]]
        await asyncio.sleep(0.05)


def assert_pools_whole(stats: dict) -> None:
    for s in stats["ranks"]:
        assert "error" not in s, s
        assert s["violations"] == [], s["violations"]
        assert s["leased"] == 0, s
        assert s["free"] + s["quarantined"] == s["pool"], s


async def until_completed(dep: Deployment, request_id: str, tokens: int = TOKENS) -> HandoffResult:
    """A handoff that completes once admission is open again (bounded retries)."""
    deadline = time.monotonic() + IDLE_BOUND
    while True:
        result = await dep.handoff(request_id, tokens, timeout=TIMEOUT)
        if result.outcome == "completed" or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def dep(ray_cluster: Any) -> Any:
    deployment = run(
        Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, round_timeout_s=ROUND_TIMEOUT, transfer_timeout_s=5.0
        )
    )
    yield deployment
    run(deployment.shutdown())


# -- 9, 10: bad input is refused at the API boundary -------------------------------------

BAD_TOKENS = [-1, 0, 10.5, "100", None, True, POOL * DEFAULT_LAYOUT.tokens_per_block + 1]
BAD_IDS = ["", "has space", "x" * 4096, 12345]


def test_bad_input_is_refused_before_any_actor_call(dep: Deployment) -> None:
    async def scenario() -> tuple[dict, dict, HandoffResult, dict]:
        before = await until_idle(dep)
        for tokens in BAD_TOKENS:
            with pytest.raises(InvalidRequest):
                await dep.handoff("bad-tokens", tokens)
        for request_id in BAD_IDS:
            with pytest.raises(InvalidRequest):
                await dep.handoff(request_id, TOKENS)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest):
                await dep.cancel(request_id)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            await dep.handoff("bad-timeout", TOKENS, timeout=0)
        after = await dep.stats()
        good = await dep.handoff("good-after-bad", TOKENS, timeout=TIMEOUT)
        return before, after, good, await until_idle(dep)

    before, after, good, settled = run(scenario())
    for role in ("ctx", "gen"):
        # No round ran for any of them: nothing reached a vote.
        assert after["coordinators"][role]["rounds"] == before["coordinators"][role]["rounds"]
        assert after["coordinators"][role]["restarts"] == 0
        assert after["coordinators"][role]["state"] == "running"
    assert [s["epoch"] for s in after["ranks"]] == [s["epoch"] for s in before["ranks"]]
    assert good.outcome == "completed", good
    assert good.bytes_verified == expected_bytes(TOKENS, 1)
    assert_pools_whole(settled)
    assert all(s["quarantined"] == 0 for s in settled["ranks"])


# -- 11: abandoned attempts are handed back -----------------------------------------------


def test_abandoned_handoffs_leak_nothing(dep: Deployment) -> None:
    """Timeouts far below a handoff's latency, callers that give up through
    `asyncio.wait_for`, and attempts superseded by a second `handoff` of the same
    id, all at random moments: every GEN and CTX block comes back, and the
    deployment serves a normal handoff right after."""
    rng = random.Random(8)

    async def one(i: int) -> list[HandoffResult]:
        kind = i % 3
        if kind == 0:
            result = await dep.handoff(f"short-{i}", TOKENS, timeout=rng.choice([0.005, 0.02, 0.05, 0.1]))
            return [result]
        if kind == 1:
            with contextlib.suppress(TimeoutError):
                return [await asyncio.wait_for(dep.handoff(f"gave-up-{i}", TOKENS, timeout=TIMEOUT), rng.uniform(0.001, 0.2))]
            return []
        first = asyncio.ensure_future(dep.handoff(f"twice-{i}", TOKENS, timeout=TIMEOUT))
        await asyncio.sleep(rng.uniform(0.0, 0.1))  # jitter only: any moment is a valid test
        second = await dep.handoff(f"twice-{i}", TOKENS, timeout=TIMEOUT)
        return [await first, second]

    async def scenario() -> tuple[list[HandoffResult], dict, HandoffResult, dict]:
        results = [r for rs in await asyncio.gather(*(one(i) for i in range(30))) for r in rs]
        settled = await until_idle(dep)
        after = await dep.handoff("normal-after-abandons", TOKENS, timeout=TIMEOUT)
        return results, settled, after, await until_idle(dep)

    results, settled, after, final = run(scenario())
    assert {r.outcome for r in results} <= OUTCOMES
    for r in results:  # never "completed" without the bytes
        assert r.outcome != "completed" or r.bytes_verified == expected_bytes(TOKENS, 1), r
    assert_pools_whole(settled)
    assert after.outcome == "completed", after
    assert_pools_whole(final)
    assert all(c["restarts"] == 0 for c in final["coordinators"].values())


def test_second_handoff_of_a_live_request_id_supersedes_it(dep: Deployment) -> None:
    """The first attempt is held mid-handoff (its OPENs wait at the GEN rank);
    a second `handoff` of the same id cancels it ("cancelled") and runs as a
    new attempt that completes with every byte."""

    async def scenario() -> tuple[HandoffResult, HandoffResult, Any, Any, dict]:
        gen = (await dep.ranks(Role.GEN))[0]
        await hold_frames(gen, "dup", Role.CTX, 0)
        first = asyncio.ensure_future(dep.handoff("dup", TOKENS, timeout=TIMEOUT))
        await asyncio.sleep(0)  # `handoff` registers its attempt before its first await
        first_parent = dep.parent("dup")
        deadline = time.monotonic() + TIMEOUT
        while not (await gen.phase.remote(first_parent))["edges"]:  # OPENs sent (held)
            assert time.monotonic() < deadline and not first.done()
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(dep.handoff("dup", TOKENS, timeout=TIMEOUT))
        await asyncio.sleep(0)
        second_parent = dep.parent("dup")
        await release_frames(gen, "dup", Role.CTX, 0)
        return await first, await second, first_parent, second_parent, await until_idle(dep)

    first, second, first_parent, second_parent, settled = run(scenario())
    assert first_parent != second_parent
    assert second_parent.ctx_attempt > first_parent.ctx_attempt
    assert first.outcome == "cancelled", first
    assert first.bytes_verified == 0
    assert second.outcome == "completed", second
    assert second.bytes_verified == expected_bytes(TOKENS, 1)
    assert_pools_whole(settled)


def test_handoffs_started_together_go_in_one_call_and_each_is_answered_at_its_own_decision(dep: Deployment) -> None:
    """Handoffs a client starts in one turn of its loop reach the GEN
    coordinator in one Ray call (`submit_many`), and their answers stream
    back: one whose OPEN is held does not hold the other's answer."""

    async def scenario() -> tuple[HandoffResult, bool, HandoffResult, dict, dict, dict]:
        gen = (await dep.ranks(Role.GEN))[0]
        before = (await dep.stats())["submits"]
        await hold_frames(gen, "held", Role.CTX, 0)
        try:
            held = asyncio.ensure_future(dep.handoff("held", TOKENS, timeout=TIMEOUT))
            free = asyncio.ensure_future(dep.handoff("free", TOKENS, timeout=TIMEOUT))
            answered = await asyncio.wait_for(asyncio.shield(free), TIMEOUT)
            still_held = not held.done() and await held_frames(gen, "held", Role.CTX, 0) > 0
            after = (await dep.stats())["submits"]
        finally:
            await release_frames(gen, "held", Role.CTX, 0)
        return answered, still_held, await held, before, after, await until_idle(dep)

    answered, still_held, held, before, after, settled = run(scenario())
    assert answered.outcome == "completed", answered
    assert answered.bytes_verified == expected_bytes(TOKENS, 1)
    assert still_held, "the free handoff's answer waited for the held one"
    assert held.outcome == "completed", held
    assert after["submit_batches"] == before["submit_batches"] + 1, (before, after)
    assert after["submit_calls"] == before["submit_calls"], (before, after)
    assert_pools_whole(settled)


def test_a_batch_answers_what_it_refuses_at_once_and_queues_nothing_of_it(dep: Deployment) -> None:
    """`submit_many` checks each request on its own: a bad size and a parent
    named twice are answered first, with the typed error `submit` raises,
    and queue nothing; the good request of the batch completes."""
    coord = dep.coordinator(Role.GEN)
    good = ParentKey(request_id="batch-good", ctx_attempt=1, gen_attempt=1)
    bad = ParentKey(request_id="batch-bad", ctx_attempt=1, gen_attempt=1)
    requests = [SubmitRequest(good, TOKENS, True), SubmitRequest(bad, 0, True), SubmitRequest(good, TOKENS, True)]

    async def scenario() -> tuple[list[list[SubmitAnswer]], dict, str | None]:
        streamed = [await ref async for ref in coord.submit_many.remote(requests)]
        return streamed, await coord.stats.remote(), await coord.outcome.remote(bad)

    streamed, stats, remembered = run(scenario())
    first = {a.index: a for a in streamed[0]}
    assert set(first) == {1, 2}, streamed
    assert isinstance(first[1].error, RoundError) and "num_tokens" in str(first[1].error), first[1]
    assert isinstance(first[2].error, ParentInFlight), first[2]
    last = [a for answers in streamed[1:] for a in answers]
    assert [(a.index, a.outcome, a.error) for a in last] == [(0, "completed", None)], streamed
    assert stats["submitted"] == 0 and stats["pending_admits"] == 0, stats
    assert remembered is None  # refused: never admitted, nothing remembered


def test_a_coordinator_error_keeps_its_message_over_a_ray_hop() -> None:
    assert str(pickle.loads(pickle.dumps(CoordinatorError("no peer")))) == "no peer"


@ray.remote(num_cpus=0)
class _Driver:
    """A driver in its own process: it submits a handoff and is killed."""

    async def submit(self, coordinator: str, parent: ParentKey, tokens: int) -> str:
        return str(await ray.get_actor(coordinator).submit.remote(parent, tokens, True))


def test_a_driver_that_dies_after_submitting_strands_nothing(dep: Deployment) -> None:
    """The ranks drive a handoff, not its client: a driver process submits,
    its request is held mid-handoff (its OPEN waits at the GEN rank), the
    driver is killed, the OPEN is let go. The handoff still completes (the GEN
    coordinator decides it), the GEN ranks return its verified blocks, the
    CTX ranks release theirs, and every pool is whole again."""

    async def scenario() -> tuple[dict, dict, dict]:
        gen = (await dep.ranks(Role.GEN))[0]
        coordinator = dep.coordinator(Role.GEN)
        before = await coordinator.stats.remote()
        parent = ParentKey(request_id="orphaned", ctx_attempt=2**32 - 7, gen_attempt=2**32 - 7)
        # Only the submission may return the GEN blocks here, not the consumer deadline.
        consume = await inside(gen, lambda self: self.side.consume_timeout)
        await inside(gen, lambda self: setattr(self.side, "consume_timeout", 3600.0))
        await hold_frames(gen, "orphaned", Role.CTX, 0)
        driver = _Driver.remote()
        driver.submit.remote(f"{dep.name}.coord.gen", parent, TOKENS)
        deadline = time.monotonic() + TIMEOUT
        while not await held_frames(gen, "orphaned", Role.CTX, 0):  # admitted in both, OPEN held
            assert time.monotonic() < deadline, "the submission never got admitted"
            await asyncio.sleep(0.01)
        ray.kill(driver)
        await release_frames(gen, "orphaned", Role.CTX, 0)
        while (await coordinator.stats.remote())["decided"].get("completed", 0) == before["decided"].get("completed", 0):
            assert time.monotonic() < deadline, "the orphaned handoff never completed"
            await asyncio.sleep(0.01)
        try:
            return before, await coordinator.stats.remote(), await until_idle(dep)
        finally:
            await inside(gen, lambda self: setattr(self.side, "consume_timeout", consume))

    before, after, settled = run(scenario())
    assert after["decided"]["completed"] == before["decided"].get("completed", 0) + 1
    assert after["submitted"] == 0  # the answer went nowhere, and nothing waits for it
    assert_pools_whole(settled)
    gen = next(s for s in settled["ranks"] if s["role"] == "gen")
    assert gen["quarantined"] == 0 and gen["counters"]["bytes_verified"] > 0


def test_attempt_memory_is_bounded_and_attempt_ids_never_repeat(dep: Deployment) -> None:
    saved = dep._recent
    dep._recent = RecentMemory(retain_s=3600.0, max_bytes=2048)  # a byte bound small enough to reach

    async def scenario() -> tuple[list[Any], list[HandoffResult]]:
        parents, results = [], []
        for request_id in [f"many-{i}" for i in range(10)] + ["many-0", "many-1"]:
            results.append(await dep.handoff(request_id, 16, timeout=TIMEOUT))
            parents.append(dep.parent(request_id))
        return parents, results

    try:
        parents, results = run(scenario())
        recent = dep._recent
    finally:
        dep._recent = saved
    assert recent.nbytes <= 2048 and len(recent) < 10 and recent.stats()["dropped_by_bytes"] > 0
    assert not dep._live
    attempts = [p.ctx_attempt for p in parents]
    assert len(set(attempts)) == len(attempts), attempts  # "many-0" again: a new id, never reused
    assert all(r.outcome == "completed" for r in results), results


def _set_retention(seconds: float) -> Any:
    """A function for `__ray_call__`: shorten every `RecentMemory` of a rank's
    endpoint or a coordinator to `seconds`; returns the previous retentions."""

    def apply(obj: Any) -> dict[str, float]:
        target = getattr(obj, "kvhandoff", obj)  # a rank host's endpoint, or the coordinator itself
        before = {}
        for name, value in vars(target).items():
            if isinstance(value, RecentMemory):
                before[name] = value.retain_s
                value.retain_s = seconds
        return before

    return apply


def test_what_ranks_and_coordinators_remember_of_finished_handoffs_ages_out(dep: Deployment) -> None:
    """Issue 22 (h) on the real actors: an outcome is remembered for a late
    question, then forgotten once it is older than the retention, so a
    long-running rank or coordinator does not grow with traffic."""
    retain = 1.5

    async def scenario() -> tuple[list[Any], list[dict], list[dict], list[Any]]:
        ranks = await dep.ranks(Role.CTX) + await dep.ranks(Role.GEN)
        coords = [dep.coordinator(Role.CTX), dep.coordinator(Role.GEN)]
        for h in ranks:
            assert "_outcome" in await h.__ray_call__.remote(_set_retention(retain))
        for c in coords:
            assert {"_outcomes", "_peer_of", "_decision_log"} <= set(await c.__ray_call__.remote(_set_retention(retain)))
        first = [await dep.handoff(f"aged-{i}", 16, timeout=TIMEOUT) for i in range(4)]
        assert all(r.outcome == "completed" for r in first), first
        # Within the retention a late question is answered from memory.
        late = [await h.wait.remote(dep.parent("aged-0"), 5.0) for h in ranks]
        before = [await h.stats.remote() for h in ranks]
        coord_before = [await c.stats.remote() for c in coords]
        await asyncio.sleep(retain * 1.5)  # the retention is the thing under test: its age must pass
        assert (await dep.handoff("aged-last", 16, timeout=TIMEOUT)).outcome == "completed"
        after = [await h.stats.remote() for h in ranks] + [await c.stats.remote() for c in coords]
        for h in ranks:
            await h.__ray_call__.remote(_set_retention(120.0))
        for c in coords:
            await c.__ray_call__.remote(_set_retention(120.0))
        return late, before + coord_before, after, first

    late, before, after, _ = run(scenario())
    assert [str(getattr(x, "value", x)) for x in late] == ["released"] * (len(late) - 1) + ["completed"], late
    assert all(s["memory"]["outcomes"]["entries"] >= 4 for s in before), [s["memory"] for s in before]
    for s in after:
        memory = s["memory"]
        assert memory["resident_bytes"] is None or memory["resident_bytes"] > 0
        # Only the last handoff is remembered; the four before it aged out.
        assert memory["outcomes"]["entries"] <= 2, memory
        assert memory["outcomes"]["dropped_by_age"] >= 4, memory
        if "peers" in memory:  # a coordinator
            assert memory["peers"]["entries"] <= 2 and memory["decision_log"]["dropped_by_age"] > 0, memory


# -- hop traces (actors/_trace.py) on the real actors ---------------------------------------


def test_a_sampled_handoff_traces_its_critical_path(dep: Deployment) -> None:
    """Every actor on the path records what reached it: the trace runs from
    the client's submission to its outcome through both coordinators, both
    CTX ranks' votes and the frames; it is read once; off, nothing is kept."""

    async def scenario() -> tuple[Any, Any, Any, Any]:
        # The round calls go over the coordinators' channels once they opened.
        opened = lambda s: sum(c["calls"].get("channel_opened", 0) for c in s["coordinators"].values()) == 3  # noqa: E731
        await wait_stats(dep, opened)
        await dep.set_trace(1)
        try:
            done = await dep.handoff("traced-1", TOKENS, timeout=TIMEOUT)
            trace = await dep.trace("traced-1")
            again = await dep.trace("traced-1")
        finally:
            await dep.set_trace(0)
        await dep.handoff("traced-2", TOKENS, timeout=TIMEOUT)
        return done, trace, again, await dep.trace("traced-2")

    done, trace, again, untraced = run(scenario())
    assert done.outcome == "completed"
    assert again is None and untraced is None
    path = [(h.actor, h.what, h.carrier) for h in trace.path]
    assert path[0] == ("client", "submit", "local") and path[-1][:2] == ("client", "outcome")
    ctx, gen = dep.ctx_spec.instance_id, dep.gen_spec.instance_id
    actors = {e.actor for e in trace.events}
    assert actors == {"client", f"coord@{ctx}", f"coord@{gen}", f"rank0@{ctx}", f"rank1@{ctx}", f"rank0@{gen}"}
    # The handoff's steps happened in causal order: admission, OPEN, the
    # data's end (every event, in time order; which branch the critical path
    # follows back from the outcome, through the OPEN or through a rank's
    # round, depends on which arrived last).
    whats = [e.what for e in trace.events]
    assert whats.index("submit") < whats.index("admit_many") < whats.index("frame:Open") < whats.index("frame:Terminal"), whats
    assert trace.hops == sum(c != "local" for _, _, c in path[1:]) == sum(trace.by_carrier.values())
    assert set(trace.by_carrier) <= {"call", "reply", "stream", "channel"}
    # Frames travel on the ranks' streams (the default carrier), round calls
    # and reports on the coordinators' channels, the rest as Ray calls.
    assert {e.carrier for e in trace.events if e.what.startswith("frame:")} == {"stream"}, trace.events
    rounds = {e.carrier for e in trace.events if e.what in ("round_vote", "round_apply", "report")}
    assert rounds == {"channel"}, trace.events
    times = [e.t_ns for e in trace.events]
    assert times == sorted(times)
    with pytest.raises(ValueError):
        run(dep.set_trace(-1))  # refused before anything changed
    with pytest.raises(InvalidRequest):
        run(dep.set_trace(1, export="yes"))  # type: ignore[arg-type]
    assert dep._trace.every == 0


def test_an_exported_trace_is_one_log_line(dep: Deployment, caplog: Any) -> None:
    """`set_trace(every, export=True)`: the deployment reads each sampled
    handoff's trace as it ends and logs it as one line with its hops."""

    async def scenario() -> Any:
        await dep.set_trace(1, export=True)
        try:
            done = await dep.handoff("exported-1", TOKENS, timeout=TIMEOUT)
            deadline = time.monotonic() + IDLE_BOUND
            while not any("exported-1" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no trace line"
                await asyncio.sleep(0.02)
            return done, await dep.trace("exported-1")
        finally:
            await dep.set_trace(0)

    with caplog.at_level("INFO", logger="kvhandoff.trace"):
        done, left = run(scenario())
    assert done.outcome == "completed" and left is None  # the export read it
    line = next(r.getMessage() for r in caplog.records if "exported-1" in r.getMessage())
    assert " completed: " in line and " hops, " in line and "client:outcome" in line, line
    hops = int(line.split(" completed: ")[1].split(" hops")[0])
    assert 6 <= hops <= 20, line


def _hold_admission_until_parked(ep: Any) -> None:
    """Inside a CTX rank: its next apply of an admission waits until the
    rank parked a frame (the GEN's OPEN beat the apply), bounded."""
    original = ep.member.round_apply

    async def held(decision: Any, epoch: Any = None) -> Any:
        if decision.admitted:
            ep.member.round_apply = original  # once
            deadline = time.monotonic() + IDLE_BOUND
            while not ep._parked and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        return await original(decision, epoch)

    ep.member.round_apply = held


def test_a_one_rank_ctx_decides_alone_and_parks_an_early_open(ray_cluster: Any) -> None:
    """A CTX instance of one rank is its own intersection: it decides a
    prepared parent at once, with no decide round (no decision of its
    coordinator ever names a parent decided, and the trace has no CTX
    report on its path). Its coordinator answers the GEN instance at the
    admission decision, so the GEN's OPEN can reach the rank before the
    rank applied the admission: the OPEN waits there (parked, not refused)
    and the handoff completes with every byte verified. (Admission in
    rounds: at the OPEN, the default, no admission waits to be applied.)"""

    async def scenario() -> tuple[Any, ...]:
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=1, pool_blocks=64, round_timeout_s=ROUND_TIMEOUT, admit_at_open=False
        )
        try:
            await dep.set_trace(1)
            # Three handoffs: the shortest path of them is the design's (a
            # report can race one hop longer on a busy box).
            first = await dep.handoff("alone", TOKENS, timeout=TIMEOUT)
            traces = [await dep.trace("alone")]
            for name in ("alone-2", "alone-3"):
                again = await dep.handoff(name, TOKENS, timeout=TIMEOUT)
                assert again.outcome == "completed", again
                traces.append(await dep.trace(name))
            trace = min(traces, key=lambda t: t.hops)
            ctx = (await dep.ranks(Role.CTX))[0]
            await inside(ctx, _hold_admission_until_parked)
            parked = await dep.handoff("parked", TOKENS, timeout=TIMEOUT)
            log = await dep.coordinator(Role.CTX).decision_log.remote()
            return first, trace, parked, log, await until_idle(dep)
        finally:
            await dep.shutdown()

    first, trace, parked, log, stats = run(scenario())
    assert first.outcome == "completed" and first.bytes_verified == expected_bytes(TOKENS, 1)
    assert parked.outcome == "completed" and parked.bytes_verified == expected_bytes(TOKENS, 1), parked
    ctx = next(s for s in stats["ranks"] if s["role"] == "ctx")
    assert ctx["counters"]["decided_alone"] == 4 and ctx["counters"]["frames_parked"] >= 1, ctx["counters"]
    assert ctx["counters"].get("refused_ProtocolError", 0) == 0
    assert all(d.decided == () for d in log) and sum(len(d.admitted) for d in log) == 4
    path = [(h.actor.split("@")[0], h.what) for h in trace.path]
    assert ("coord", "report") in path  # the GEN instance's completion
    assert path.count(("coord", "report")) == 1 and trace.hops <= 10, path
    assert_pools_whole(stats)


def test_the_blocking_wrapper_hands_off_and_leaves_no_thread(ray_cluster: Any) -> None:
    """`launch_sync` for scripts: a handoff completes with every byte
    verified, and `shutdown` (idempotent) ends the wrapper's loop thread and
    closes its loop; a call after it is refused with a typed error. A thread
    left behind keeps its tasks, and their Ray references, alive into
    whatever the process does next."""
    before = {t.ident for t in threading.enumerate()}
    sync = Deployment.launch_sync(ctx_tp=1, gen_tp=1, pool_blocks=64, round_timeout_s=ROUND_TIMEOUT)
    try:
        loop_threads = [t for t in threading.enumerate() if t.ident not in before and t.name == "kvhandoff-loop"]
        result = sync.handoff("sync-1", TOKENS, timeout=TIMEOUT)
    finally:
        sync.shutdown()
    sync.shutdown()
    assert result.outcome == "completed" and result.bytes_verified == expected_bytes(TOKENS, 1), result
    assert len(loop_threads) == 1 and not loop_threads[0].is_alive()
    assert sync._runner.loop.is_closed()
    with pytest.raises(DeploymentClosed):
        sync.handoff("sync-2", TOKENS)


def test_a_script_that_launches_blocking_gets_no_ray_thread_warning(tmp_path: Any) -> None:
    """A script's `launch_sync` starts Ray itself, in the script's own
    thread: Ray sets its signal handlers there and prints no "SIGTERM
    handler is not set" (it did when the wrapper's loop thread started it)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import ray\n"
        "from kvhandoff.actors import Deployment\n"
        "dep = Deployment.launch_sync(ctx_tp=1, gen_tp=1, pool_blocks=32)\n"
        "result = dep.handoff('one', 50, timeout=60)\n"
        "dep.shutdown()\n"
        "ray.shutdown()\n"
        "print('OUTCOME', result.outcome)\n"
    )
    # RAY_ADDRESS=local: the script's plain ray.init() starts its own cluster
    # even where a `ray start` one runs on this machine (it would join that).
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "OUTCOME completed" in proc.stdout, proc.stderr[-2000:]
    assert "SIGTERM handler is not set" not in proc.stderr, proc.stderr[-2000:]


# -- 13: a dead rank is an outcome, and "completed" never lies -----------------------------


def test_gen_rank_killed_under_load_gives_outcomes_not_exceptions(ray_cluster: Any) -> None:
    import ray

    async def scenario() -> tuple[list[Any], HandoffResult, dict]:
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=2, pool_blocks=256, round_timeout_s=2.0, transfer_timeout_s=4.0
        )
        try:
            gen = await dep.ranks(Role.GEN)
            calls = [asyncio.ensure_future(dep.handoff(f"load-{i}", TOKENS, timeout=TIMEOUT)) for i in range(24)]
            deadline = time.monotonic() + TIMEOUT
            while (await gen[0].stats.remote())["leased"] == 0:  # handoffs in flight on it
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            ray.kill(gen[0])
            results = await asyncio.gather(*calls, return_exceptions=True)
            fresh = await until_completed(dep, "after-gen-death")
            return results, fresh, await until_idle(dep)
        finally:
            await dep.shutdown()

    results, fresh, settled = run(scenario())
    raised = [r for r in results if isinstance(r, BaseException)]
    assert raised == [], raised
    assert {r.outcome for r in results} <= OUTCOMES
    assert any(r.outcome != "completed" for r in results)  # the kill landed mid-load
    for r in results:
        assert r.outcome != "completed" or r.bytes_verified == expected_bytes(TOKENS, 2), r
    assert fresh.outcome == "completed" and fresh.bytes_verified == expected_bytes(TOKENS, 2), fresh
    for s in settled["ranks"]:
        assert "error" not in s and s["leased"] == 0, s


# -- 11, 15: a dead coordinator; stats and shutdown -----------------------------------------


def test_shutdown_ends_a_handoff_in_flight(ray_cluster: Any) -> None:
    """A handoff still in flight when `shutdown()` is called ends with
    `DeploymentClosed` (its task is the handle's own), not with a failure
    from the actors shutdown killed, nor at its timeout."""

    async def scenario() -> None:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=POOL, round_timeout_s=ROUND_TIMEOUT)
        closed = False
        try:
            gen = (await dep.ranks(Role.GEN))[0]
            await defer_opens(gen, "held")  # admitted, never opened: in flight until shut down
            call = asyncio.ensure_future(dep.handoff("held", TOKENS, timeout=600.0))
            while not await deferred_opens(gen, "held"):  # observable: the GEN rank holds it
                assert not call.done(), call.result()
                await asyncio.sleep(0.02)
            await dep.shutdown()
            closed = True
            with pytest.raises(DeploymentClosed):
                await asyncio.wait_for(call, IDLE_BOUND)
        finally:
            if not closed:
                await dep.shutdown()

    run(scenario())



@pytest.mark.parametrize("admit_at_open", [False, True], ids=["rounds", "at_open"])
def test_dead_coordinator_fails_handoffs_cleanly_and_stats_still_work(ray_cluster: Any, admit_at_open: bool) -> None:
    """With the CTX coordinator (and so its ranks) dead, each handoff returns
    "failed" and no GEN block stays leased: admitting in rounds, the GEN
    side never admits one (its round needs the dead CTX coordinator's
    admission); admitting at the OPEN, the GEN side admits each (alone or
    in a round of its own), its OPENs find the dead rank, and each ends
    failed. stats() reports the
    dead coordinator and the live GEN rank; after shutdown() every call
    raises DeploymentClosed, and shutdown() is idempotent."""
    import ray

    async def scenario() -> tuple[list[Any], dict, Deployment]:
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=1, pool_blocks=64, round_timeout_s=ROUND_TIMEOUT, admit_at_open=admit_at_open
        )
        try:
            assert (await dep.handoff("before", TOKENS, timeout=TIMEOUT)).outcome == "completed"
            if admit_at_open:
                # A lone handoff went to the GEN rank; two at once go through
                # the GEN coordinator, which learns how its peer admits.
                assert dep.calls["receive_at_rank"] == 1, dep.calls
                warm = await asyncio.gather(*(dep.handoff(f"before-{i}", TOKENS, timeout=TIMEOUT) for i in range(2)))
                assert [r.outcome for r in warm] == ["completed"] * 2, warm
            coordinator = dep.coordinator(Role.CTX)
            ctx_ranks = await dep.ranks(Role.CTX)
            pids = [await inside(r, lambda self: os.getpid()) for r in ctx_ranks]
            ray.kill(coordinator)
            # Dead before the handoffs start, not in the middle of one: the
            # coordinator and, with it, the ranks it owns (Ray ends an owner's
            # actors some time after the owner; a rank still up would serve an
            # OPEN that reaches it over its stream, and that handoff would
            # complete, correctly, with its bytes verified). Ray's DEAD mark
            # can precede the rank process's exit, and the process serves its
            # stream until it exits: wait for both.
            deadline = time.monotonic() + IDLE_BOUND
            for actor, call in [(coordinator, "stats"), *((r, "ping") for r in ctx_ranks)]:
                while True:
                    try:
                        await getattr(actor, call).remote()
                    except ray.exceptions.RayActorError:
                        break
                    assert time.monotonic() < deadline, actor
                    await asyncio.sleep(0.05)
            for pid in pids:
                while _pid_alive(pid):
                    assert time.monotonic() < deadline, pid
                    await asyncio.sleep(0.05)
            results = await asyncio.gather(
                *(dep.handoff(f"orphaned-{i}", TOKENS, timeout=TIMEOUT) for i in range(8)), return_exceptions=True
            )
            # Blocks quarantined for the dead writer come back by the GEN
            # rank's reclaim restart, some time after the outcomes: wait for
            # the restart to end and the pool to be whole (bounded), not just
            # for no lease.
            deadline = time.monotonic() + IDLE_BOUND
            while True:
                stats = await until_idle(dep)
                gen = [s for s in stats["ranks"] if s.get("role") == "gen" and "error" not in s]
                running = stats["coordinators"]["gen"].get("state") == "running"
                if running and gen and all(s["free"] == s["pool"] for s in gen):
                    return results, stats, dep
                assert time.monotonic() < deadline, gen
                await asyncio.sleep(0.05)
        finally:
            await dep.shutdown()
            await dep.shutdown()

    results, stats, dep = run(scenario())
    # Admitting at the OPEN, the first failed OPEN quarantines GEN blocks for
    # the dead writer and the GEN rank's reclaim restart follows: a handoff
    # still queued for a round then is refused ("rejected") instead.
    endings = ("failed",) if not admit_at_open else ("failed", "cancelled", "rejected")
    assert all(isinstance(r, HandoffResult) and r.outcome in endings for r in results), results
    assert stats["coordinators"]["ctx"]["state"] == "unreachable"
    assert stats["coordinators"]["gen"]["state"] == "running"
    decided = stats["coordinators"]["gen"]["decided"]
    if not admit_at_open:
        # GEN never admitted them: its round needs the CTX instance's admission
        # too, and the dead CTX coordinator's is a failure (vetoed, "failed").
        assert decided.get("admitted", 0) == 1, decided  # "before" only
        assert decided.get("rejected", 0) == len(results), decided
    else:
        # The GEN side admitted each with no word from the CTX coordinator
        # (alone while idle, else in a round of its own with no peer
        # admission), its OPEN found the dead rank: every one ended
        # (failed, cancelled by the client once its call failed, or refused
        # while the GEN rank restarted to reclaim its quarantined blocks).
        assert stats["coordinators"]["gen"]["peers_admitting_at_open"], stats["coordinators"]["gen"]
        # (counted by the coordinator: the rank may be a later incarnation by
        # now, restarted to reclaim what it quarantined for the dead writer;
        # "before-0/1" were admitted alone or, while learning the peer, in a round)
        calls = stats["coordinators"]["gen"]["calls"]
        admitted = calls.get("rank_admit_alone", 0) + decided.get("admitted", 0)
        assert admitted >= 3, (calls, decided)  # "before-0/1" and at least the first of the eight
        ended = sum(r.outcome in ("failed", "cancelled") for r in results)
        assert ended >= 1 and decided.get("failed", 0) + decided.get("cancelled", 0) >= ended, (decided, results)
    assert stats["coordinators"]["gen"]["in_flight"] == 0, stats["coordinators"]["gen"]
    gen = [s for s in stats["ranks"] if s.get("role") == "gen"]
    assert len(gen) == 1 and "error" not in gen[0] and gen[0]["leased"] == 0, gen
    assert gen[0]["free"] == gen[0]["pool"]

    async def after_shutdown() -> None:
        for call in (dep.handoff("late", TOKENS), dep.cancel("late"), dep.stats()):
            with pytest.raises(DeploymentClosed):
                await call
        await dep.shutdown()

    run(after_shutdown())


# -- 8, 14: launch --------------------------------------------------------------------------


def _named(prefix: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def _alive_ranks() -> int:
    from ray._private import state

    return sum(
        1 for a in state.actors().values() if "RankCore" in a.get("ActorClassName", "") and a.get("State") == "ALIVE"
    )


async def _until(condition: Any, bound: float = IDLE_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(
    "bad",
    [
        {"ctx_tp": 3},  # 8 KV heads do not split over 3 ranks
        {"ctx_tp": 16},  # more ranks than heads
        {"gen_tp": 0},
        {"ctx_tp": -1},
        {"pool_blocks": 0},
        {"pool_blocks": -5},
        {"memory": "HBM"},
        {"round_timeout_s": 0},
        {"start_timeout_s": -1.0},
        {"gpus_per_rank": 0},
        {"gpus_per_rank": 1.5},  # a share of one GPU, or whole GPUs
        {"gpus_per_rank": True},
    ],
    ids=str,
)
def test_invalid_config_is_refused_before_any_actor_starts(ray_cluster: Any, bad: dict) -> None:
    name = "kvh-badcfg"
    started = time.monotonic()
    with pytest.raises(InvalidConfig):
        run(Deployment.launch(name=name, **bad))
    assert time.monotonic() - started < 5.0  # no actor was waited for
    assert _named(name) == []


def test_vram_without_a_gpu_fails_at_once(ray_cluster: Any) -> None:
    if ray_cluster.cluster_resources().get("GPU"):
        pytest.skip("this cluster has a GPU")
    with pytest.raises(InvalidConfig, match="no GPU"):
        run(Deployment.launch(name="kvh-vram", memory="VRAM"))
    assert _named("kvh-vram") == []


def test_rank_that_dies_while_starting_fails_the_launch_at_once(ray_cluster: Any) -> None:
    """A pool no host can allocate: every rank's constructor raises. The launch
    fails with the rank and the cause, long before the start limit, and
    leaves nothing behind."""
    name = "kvh-dies"
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as info:
        run(Deployment.launch(name=name, ctx_tp=1, gen_tp=1, pool_blocks=2**31, start_timeout_s=600.0))
    assert time.monotonic() - started < 120.0  # a death, not the 600 s limit
    text = str(info.value)
    assert "rank 0" in text and "died" in text, text
    assert "allocate" in text.lower(), text  # the death cause itself
    run(_until(lambda: _named(name) == []))


def test_start_limit_names_the_ranks_and_kills_everything(ray_cluster: Any) -> None:
    """`start_timeout_s` passes while the ranks are still starting: the error
    names every rank that had not started and why, and every actor the launch
    started (directory, coordinators, rank actors) is gone."""
    name = "kvh-slow"
    before = _alive_ranks()
    with pytest.raises(LaunchFailed) as info:
        run(Deployment.launch(name=name, ctx_tp=2, gen_tp=1, start_timeout_s=0.05))
    failure = info.value
    assert "did not start within" in str(failure), failure
    assert failure.not_started, failure  # which ranks (or coordinators) and why
    run(_until(lambda: _named(name) == [] and _alive_ranks() <= before))


def test_launch_that_fails_after_starting_actors_kills_them(ray_cluster: Any) -> None:
    """The GEN coordinator's name is taken: the directory and the CTX
    coordinator were already started, and are killed again."""
    import ray

    name = "kvh-taken"

    @ray.remote(num_cpus=0)
    class Squatter:
        def ping(self) -> int:
            return 1

    squatter = Squatter.options(name=f"{name}.coord.gen").remote()
    ray.get(squatter.ping.remote())
    try:
        with pytest.raises(LaunchFailed):
            run(Deployment.launch(name=name, ctx_tp=1, gen_tp=1))
        run(_until(lambda: _named(name) == [f"{name}.coord.gen"]))
    finally:
        ray.kill(squatter)
