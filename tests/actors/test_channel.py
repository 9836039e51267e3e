"""Round calls over a TCP channel between a coordinator and its ranks
(`control_frames="stream"`, actors/_channel.py).

What would fail if it broke:
* calls go both ways on one connection and each reply reaches its own call,
  decoded into the method's type; requests start in the order they came; a
  handler's exception comes back as a `RemoteCallError` naming its type;
* a connection without the token, a length over `MAX_CALL_LEN`, or a body
  that is not the envelope is closed before any handler runs; an unknown
  method or arguments that do not decode into the method's types (the
  protocol's bounds included) are answered with an error and run nothing;
* when the connection closes, every call waiting on it fails with
  `ConnectionError` at once, and later calls take the Ray call (`RankLinks`);
  a message over the bound takes the Ray call; a replaced incarnation's
  channel is never used for the new one;
* on the real rank actors, every round call and report of a stream
  deployment goes over the channels (none over Ray calls once they opened),
  with every byte verified and every pool whole; a killed rank's channel
  fails its calls, the fail policy restarts it, a new channel opens to the
  new incarnation, and the next handoff completes; under
  `control_frames="ray"` no channel opens and the rounds use Ray calls;
* a client's submissions: once its channel to the GEN coordinator opened,
  every submission goes over it and completes, an error of `WIRE_ERRORS`
  (a parent already in flight) arrives as itself, any other as a
  `RemoteCallError`; a coordinator that dies fails the submissions waiting
  on its channel at once; a Ray-frames deployment offers no channel.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import msgspec
import pytest

from kvhandoff.actors import _channel
from kvhandoff.actors._channel import (
    MAX_CALL_LEN,
    RESULTS,
    CallChannel,
    CallServer,
    Handler,
    RankLinks,
    RemoteCallError,
    carried_by,
    connect,
)
from kvhandoff.actors._stream import TOKEN_LEN
from kvhandoff.protocol import MAX_ROUND_ITEMS, ParentKey, RoundDecision

pytestmark = pytest.mark.ray

BOUND_S = 60.0  # a failure's bound, not a pace


class _Rank:
    """A stand-in for a rank's round methods: it records what ran, in order."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, Any]] = []
        self.carriers: list[str] = []
        self.gate: asyncio.Event | None = None  # every call waits on it
        self.gates: dict[int, asyncio.Event] = {}  # a round's call waits on its own

    async def round_apply(self, decision: RoundDecision, epoch: int | None) -> int:
        self.ran.append(("apply", decision.round_no))
        self.carriers.append(carried_by())
        if self.gate is not None:
            await self.gate.wait()
        if decision.round_no in self.gates:
            await self.gates[decision.round_no].wait()
        if decision.round_no == 13:
            raise ValueError("unlucky round")
        if decision.round_no == 14:
            return object()  # type: ignore[return-value]  # nothing the wire can carry
        return decision.round_no


def _handlers(rank: _Rank) -> dict[str, Handler]:
    return {"round_apply": Handler(msgspec.msgpack.Decoder(tuple[RoundDecision, int | None]), rank.round_apply)}


async def _pair(rank: _Rank) -> tuple[CallServer, CallChannel, collections.Counter[str]]:
    """A server answering `rank`'s methods, and a channel connected to it."""
    server_counters: collections.Counter[str] = collections.Counter()
    server = CallServer(lambda: "127.0.0.1", _handlers(rank), lambda ch: None, server_counters)
    host, port, token = await server.address()
    channel = await connect(host, port, token, {}, collections.Counter())
    return server, channel, server_counters


def _decision(n: int) -> RoundDecision:
    return RoundDecision(round_no=n)


def test_calls_are_answered_each_with_its_own_reply_in_arrival_order() -> None:
    async def scenario() -> tuple[_Rank, list[Any], list[Any]]:
        rank = _Rank()
        server, channel, _ = await _pair(rank)
        futures = [channel.call("round_apply", (_decision(n), 1), RESULTS["round_apply"]) for n in (5, 13, 7, 14)]
        assert all(f is not None for f in futures)
        async with asyncio.timeout(BOUND_S):
            replies = await asyncio.gather(*futures, return_exceptions=True)  # type: ignore[arg-type]
        channel.close()
        server.close()
        return rank, replies, rank.carriers

    rank, replies, carriers = asyncio.run(scenario())
    assert rank.ran == [("apply", 5), ("apply", 13), ("apply", 7), ("apply", 14)]  # started as they came
    assert replies[0] == 5 and replies[2] == 7
    error = replies[1]
    assert isinstance(error, RemoteCallError) and error.type_name == "ValueError" and "unlucky" in str(error)
    # A result the wire cannot carry is an error reply, not a call left waiting.
    assert isinstance(replies[3], RemoteCallError) and replies[3].type_name == "TypeError", replies[3]
    assert carriers == ["channel"] * 4  # the handler knows what carried it (traces)
    assert carried_by() == "call"  # outside a channel's handler: a Ray call


def test_a_reply_never_reaches_another_call_when_handlers_finish_out_of_order() -> None:
    async def scenario() -> tuple[int, bool, int]:
        rank = _Rank()
        rank.gates[3] = asyncio.Event()
        server, channel, _ = await _pair(rank)
        first = channel.call("round_apply", (_decision(3), None), RESULTS["round_apply"])
        second = channel.call("round_apply", (_decision(4), None), RESULTS["round_apply"])
        assert first is not None and second is not None
        async with asyncio.timeout(BOUND_S):
            got_second = await second
        first_waited = not first.done()
        rank.gates[3].set()
        async with asyncio.timeout(BOUND_S):
            got_first = await first
        channel.close()
        server.close()
        return got_second, first_waited, got_first

    assert asyncio.run(scenario()) == (4, True, 3)


async def _stray(server: CallServer, payload: bytes) -> bytes:
    """Connect to `server` as a stranger, send `payload`; what comes back before it closes."""
    host, port, _ = await server.address()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(payload)
    async with asyncio.timeout(BOUND_S):
        back = await reader.read()
    writer.close()
    return back


def _request(method: str, args: Any, call_id: int = 1) -> bytes:
    body = msgspec.msgpack.encode((0, call_id, method, args))
    return len(body).to_bytes(4, "little") + body


def test_strangers_and_malformed_messages_run_nothing() -> None:
    async def scenario() -> tuple[_Rank, collections.Counter[str], list[bytes]]:
        rank = _Rank()
        counters: collections.Counter[str] = collections.Counter()
        server = CallServer(lambda: "127.0.0.1", _handlers(rank), lambda ch: None, counters)
        _, _, token = await server.address()
        good = _request("round_apply", (_decision(1), None))
        backs = [
            await _stray(server, b"z" * TOKEN_LEN + good),  # the wrong token: closed, nothing read
            await _stray(server, token.encode() + (MAX_CALL_LEN + 1).to_bytes(4, "little") + good),
            await _stray(server, token.encode() + (3).to_bytes(4, "little") + b"\xc1\xc1\xc1" + good),
        ]
        server.close()
        return rank, counters, backs

    rank, counters, backs = asyncio.run(scenario())
    assert rank.ran == [] and backs == [b"", b"", b""]
    assert counters["channel_refused_token"] == 1
    assert counters["channel_dropped_oversize"] == 1
    assert counters["channel_dropped_malformed"] == 1


def test_an_unknown_method_or_arguments_out_of_bounds_are_answered_with_an_error() -> None:
    too_many = tuple(ParentKey(f"r{i}", 0, 0) for i in range(MAX_ROUND_ITEMS + 1))

    async def scenario() -> tuple[_Rank, list[Any], collections.Counter[str]]:
        rank = _Rank()
        server, channel, counters = await _pair(rank)
        calls = [
            channel.call("format_disk", (), RESULTS["round_apply"]),
            channel.call("round_apply", ("not a decision", 1), RESULTS["round_apply"]),
            channel.call("round_apply", ({"type": "round_decision", "round_no": 2, "failed": too_many}, 1),
                         RESULTS["round_apply"]),
            channel.call("round_apply", (_decision(9), 1), RESULTS["round_apply"]),  # the channel still serves
        ]
        async with asyncio.timeout(BOUND_S):
            replies = await asyncio.gather(*calls, return_exceptions=True)  # type: ignore[arg-type]
        channel.close()
        server.close()
        return rank, replies, counters

    rank, replies, counters = asyncio.run(scenario())
    assert rank.ran == [("apply", 9)]  # nothing else ran
    assert [type(r) for r in replies[:3]] == [RemoteCallError] * 3, replies
    assert replies[0].type_name == "LookupError"
    assert replies[1].type_name == replies[2].type_name == "ValidationError", replies
    assert replies[3] == 9
    assert counters["channel_refused"] == 3


def test_a_closed_channel_fails_what_waits_and_takes_no_more_calls() -> None:
    async def scenario() -> tuple[Any, Any, bool]:
        rank = _Rank()
        rank.gate = asyncio.Event()  # never set: the call waits until the close
        server, channel, _ = await _pair(rank)
        waiting = channel.call("round_apply", (_decision(2), 1), RESULTS["round_apply"])
        assert waiting is not None
        async with asyncio.timeout(BOUND_S):
            while not rank.ran:
                await asyncio.sleep(0.01)
        server.close()  # the rank's process goes away
        try:
            async with asyncio.timeout(BOUND_S):
                await waiting
        except ConnectionError as exc:
            failed: Any = exc
        else:
            failed = None
        async with asyncio.timeout(BOUND_S):
            await channel.done
        later = channel.call("round_apply", (_decision(3), 1), RESULTS["round_apply"])
        told = channel.tell("round_apply", (_decision(3), 1))
        return failed, later, told

    failed, later, told = asyncio.run(scenario())
    assert isinstance(failed, ConnectionError)
    assert later is None and told is False  # the caller takes the Ray call


class _Remote:
    """A Ray method's stand-in: `.remote(*args)` records the call."""

    def __init__(self, calls: list[Any], name: str, answer: Any) -> None:
        self._calls, self._name, self._answer = calls, name, answer

    def remote(self, *args: Any) -> Any:
        self._calls.append((self._name, args))
        return self._answer()


class _Handle:
    """What `RankLinks` uses of a rank's actor handle."""

    def __init__(self, address: Any) -> None:
        self.calls: list[Any] = []
        self.call_address = _Remote(self.calls, "call_address", address)

        def applied() -> asyncio.Future[int]:
            future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            future.set_result(-1)
            return future

        self.round_apply = _Remote(self.calls, "round_apply", applied)


def test_rank_links_use_the_channel_of_that_incarnation_only_and_fall_back_to_ray_calls(monkeypatch: Any) -> None:
    async def unreachable() -> Any:
        raise ConnectionRefusedError("no server here")

    async def scenario() -> dict[str, Any]:
        rank = _Rank()
        counters: collections.Counter[str] = collections.Counter()
        server = CallServer(lambda: "127.0.0.1", _handlers(rank), lambda ch: None, collections.Counter())
        tasks: set[asyncio.Task[Any]] = set()
        links = RankLinks({}, counters, lambda coro: tasks.add(asyncio.get_running_loop().create_task(coro)))
        seen: dict[str, Any] = {}
        live, dead = _Handle(server.address), _Handle(unreachable)
        links.open(0, live)
        links.open(1, dead)
        # Before it opened: the Ray call.
        _, seen["before"] = links.call(0, live, "round_apply", (_decision(1), 1), RESULTS["round_apply"])
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*tasks)
        reply, seen["open"] = links.call(0, live, "round_apply", (_decision(2), 1), RESULTS["round_apply"])
        seen["open_reply"] = await reply
        _, seen["unreachable"] = links.call(1, dead, "round_apply", (_decision(2), 1), RESULTS["round_apply"])
        # Another handle as rank 0 (a harness wrapper, a new incarnation): never this channel.
        other = _Handle(server.address)
        _, seen["other_handle"] = links.call(0, other, "round_apply", (_decision(3), 1), RESULTS["round_apply"])
        # Over the bound: the Ray call, the channel stays open.
        monkeypatch.setattr(_channel, "MAX_CALL_LEN", 8)
        _, seen["oversize"] = links.call(0, live, "round_apply", (_decision(4), 1), RESULTS["round_apply"])
        monkeypatch.setattr(_channel, "MAX_CALL_LEN", MAX_CALL_LEN)
        seen["open_count"] = links.open_count()
        links.drop(0, other)  # not its channel: nothing closes
        seen["after_wrong_drop"] = links.open_count()
        links.drop(0, live)
        _, seen["dropped"] = links.call(0, live, "round_apply", (_decision(5), 1), RESULTS["round_apply"])
        seen["counters"] = counters
        seen["ray_calls"] = [c for h in (live, dead, other) for c in h.calls if c[0] == "round_apply"]
        links.close()
        server.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen["before"] == "reply" and seen["open"] == "channel" and seen["open_reply"] == 2
    assert seen["unreachable"] == seen["other_handle"] == seen["oversize"] == seen["dropped"] == "reply"
    assert seen["open_count"] == 1 and seen["after_wrong_drop"] == 1
    assert seen["counters"]["channel_opened"] == 1 and seen["counters"]["channel_open_failed"] == 1
    assert seen["counters"]["channel_oversize_sent_by_ray"] == 1
    assert sorted(args[0].round_no for _, args in seen["ray_calls"]) == [1, 2, 3, 4, 5]


# ---- the real rank actors --------------------------------------------------------------


def _round_counters(stats: dict) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """The coordinators' calls and the ranks' counters, each summed."""
    coords: collections.Counter[str] = collections.Counter()
    for c in stats["coordinators"].values():
        coords.update(c.get("calls", {}))
    ranks: collections.Counter[str] = collections.Counter()
    for s in stats["ranks"]:
        ranks.update(s["counters"])
    return coords, ranks


def test_rank_actors_take_every_round_call_and_report_over_the_channels(ray_cluster: Any) -> None:
    from .helpers import assert_carried, assert_clean, carried_handoffs

    done, cancelled, _, stats = asyncio.run(carried_handoffs("stream", "ch"))
    assert_carried(done, cancelled)
    assert_clean(stats)
    coords, ranks = _round_counters(stats)
    tp = len(stats["ranks"])
    assert coords["channel_opened"] == tp and coords.get("channel_open_failed", 0) == 0, coords
    assert ranks["channel_accepted"] == tp, ranks
    # The round calls: every one after the channels opened went over them.
    round_calls = coords["rank_vote_calls"] + coords["rank_apply_calls"] + coords.get("rank_admit_alone", 0)
    assert round_calls > 0 and coords["channel_calls"] >= round_calls - 2 * tp, coords
    # Reports: pushed on the channel (one way), as many as were sent.
    assert ranks["reports_sent"] > 0 and ranks["channel_tells"] == ranks["reports_sent"], ranks
    assert coords["reports_received"] == ranks["reports_sent"], (coords, ranks)


def test_rank_actors_under_ray_frames_open_no_channel(ray_cluster: Any) -> None:
    from .helpers import assert_carried, assert_clean, carried_handoffs

    done, cancelled, _, stats = asyncio.run(carried_handoffs("ray", "chr"))
    assert_carried(done, cancelled)
    assert_clean(stats)
    coords, ranks = _round_counters(stats)
    assert coords.get("channel_opened", 0) == 0 and coords.get("channel_calls", 0) == 0, coords
    assert coords["channel_open_failed"] == len(stats["ranks"]), coords
    assert ranks.get("channel_tells", 0) == 0 and ranks["reports_sent"] == coords["reports_received"]


def test_a_killed_rank_fails_its_channel_calls_and_its_new_incarnation_gets_a_new_channel(ray_cluster: Any) -> None:
    """A GEN rank dies with a handoff in flight: the handoff ends failed
    within the round bound (its channel's calls failed, not hung), the fail
    policy restarts the rank, the coordinator opens a channel to the new
    incarnation, and the next handoffs complete with every byte verified
    over it; every pool comes back whole."""
    import ray

    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import assert_clean, gen_bytes, settled_stats, wait_stats

    async def scenario() -> tuple[Any, list[Any], dict, dict]:
        dep = await Deployment.launch(
            ctx_tp=1, gen_tp=2, pool_blocks=32, chunk_bytes=64 << 10, round_timeout_s=5.0,
            control_frames="stream",
        )
        try:
            first = await dep.handoff("kill-0", 100, timeout=BOUND_S)
            assert first.outcome == "completed", first
            before = await dep.stats()
            victim = (await dep.ranks(Role.GEN))[1]
            from kvhandoff.cli.harness import held_frames, hold_frames

            ctx = (await dep.ranks(Role.CTX))[0]
            await hold_frames(ctx, "kill-1", Role.GEN, 1)  # kill-1 stays in flight at GEN rank 1
            pending = asyncio.ensure_future(dep.handoff("kill-1", 100, timeout=BOUND_S))
            async with asyncio.timeout(BOUND_S):  # in flight: CTX answered GEN rank 1's OPEN
                while not await held_frames(ctx, "kill-1", Role.GEN, 1):
                    await asyncio.sleep(0.02)
            ray.kill(victim)
            async with asyncio.timeout(BOUND_S):
                doomed = await pending
            await wait_stats(dep, lambda s: _round_counters(s)[0]["channel_opened"] >= 4, BOUND_S)
            after = [await dep.handoff(f"kill-{i}", 100, timeout=BOUND_S) for i in (2, 3)]
            return doomed, after, before, await settled_stats(dep, BOUND_S)
        finally:
            await dep.shutdown()

    doomed, after, before, stats = asyncio.run(scenario())
    assert doomed.outcome == "failed", doomed
    assert [r.outcome for r in after] == ["completed", "completed"], after
    assert all(r.bytes_verified == gen_bytes(100, 2) for r in after)
    coords_before, _ = _round_counters(before)
    coords, _ = _round_counters(stats)
    assert coords_before["channel_opened"] == 3  # one per rank
    assert coords["channel_opened"] == 4, coords  # and one to the new incarnation
    assert coords["channel_calls"] > coords_before["channel_calls"]
    assert_clean(stats)


# ---- client channels: submissions (actors/_submit.py, actors/_coordinator_clients.py) --------


def test_errors_of_the_wire_list_arrive_as_themselves_and_others_generic() -> None:
    """A handler's `InstanceDraining` (or another error of `WIRE_ERRORS`)
    is raised at the caller as that very type with its arguments: a client
    tells a draining instance from a broken call as it would over Ray. Any
    other error stays a `RemoteCallError`."""
    from kvhandoff.actors._coordinator_errors import InstanceDraining, RoundTimeout

    errors: list[BaseException] = [
        InstanceDraining("gen0", "draining"), RoundTimeout("gen0", 7, (1,), 2.0), KeyError("nope"),
    ]

    async def raise_next(decision: RoundDecision, epoch: int | None) -> int:
        raise errors[decision.round_no - 1]

    async def scenario() -> list[Any]:
        server = CallServer(
            lambda: "127.0.0.1",
            {"round_apply": Handler(msgspec.msgpack.Decoder(tuple[RoundDecision, int | None]), raise_next)},
            lambda ch: None, collections.Counter(),
        )
        channel = await connect(*await server.address(), {}, collections.Counter())
        futures = [channel.call("round_apply", (_decision(n), None), RESULTS["round_apply"]) for n in (1, 2, 3)]
        async with asyncio.timeout(BOUND_S):
            got = await asyncio.gather(*futures, return_exceptions=True)  # type: ignore[arg-type]
        channel.close()
        server.close()
        return got

    draining, timeout, other = asyncio.run(scenario())
    assert type(draining) is InstanceDraining and draining.topology == "gen0" and draining.reason == "draining"
    assert type(timeout) is RoundTimeout and timeout.missing_ranks == (1,) and timeout.round_no == 7
    assert isinstance(other, RemoteCallError) and other.type_name == "KeyError"


def test_submissions_go_over_the_client_channel_with_their_errors_typed(ray_cluster: Any) -> None:
    """On the real actors of a stream deployment: once a client's channel to
    the GEN coordinator opened, its submissions go over it (none by Ray
    call), each completing with every byte verified; a second submission of
    a parent in flight is refused with `ParentInFlight` itself, and changes
    nothing (the first completes). A Ray-frames deployment offers no channel:
    its client submits by Ray call."""
    from kvhandoff.actors._coordinator_errors import ParentInFlight
    from kvhandoff.actors._submit import SubmitRequest, Submitter
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.cli.harness import held_frames, hold_frames, release_frames
    from kvhandoff.protocol import Role

    from .helpers import assert_clean, gen_bytes, settled_stats

    async def run_on(frames: str) -> tuple[list[Any], Any, Submitter, dict, dict]:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=2, pool_blocks=64, round_timeout_s=10.0, control_frames=frames)
        try:
            first = await asyncio.gather(*(dep.handoff(f"{frames}-a{i}", 100, timeout=BOUND_S) for i in range(4)))
            async with asyncio.timeout(BOUND_S):  # the channel opens beside the first submissions
                while frames == "stream" and not dep._submitter.channel_counters["channel_opened"]:
                    await asyncio.sleep(0.01)
            before = dict(dep._submitter.counters)
            second = await asyncio.gather(*(dep.handoff(f"{frames}-b{i}", 100, timeout=BOUND_S) for i in range(6)))
            # The same parent twice, straight to the coordinator: the first
            # held in flight (CTX holds its frames to GEN rank 0).
            submitter = Submitter()
            coord = dep.coordinator(Role.GEN)
            ctx = (await dep.ranks(Role.CTX))[0]
            parent = ParentKey(request_id=f"{frames}-dup", ctx_attempt=1, gen_attempt=1)
            await hold_frames(ctx, parent.request_id, Role.GEN, 0)
            held = submitter.submit(coord, SubmitRequest(parent, 16, True))
            async with asyncio.timeout(BOUND_S):
                while frames == "stream" and not submitter.channel_counters["channel_opened"]:
                    await asyncio.sleep(0.01)
                while not await held_frames(ctx, parent.request_id, Role.GEN, 0):
                    await asyncio.sleep(0.01)
            twice = submitter.submit(coord, SubmitRequest(parent, 16, True))
            async with asyncio.timeout(BOUND_S):
                refused = await asyncio.gather(twice, return_exceptions=True)
                await release_frames(ctx, parent.request_id, Role.GEN, 0)
                outcome = await held
            submitter.close()
            after = dict(dep._submitter.counters)
            stats = await settled_stats(dep, BOUND_S)
            return [*first, *second], (refused[0], outcome), after | {"before": before}, submitter.counters, stats
        finally:
            await dep.shutdown()

    for frames in ("stream", "ray"):
        results, (refused, outcome), client, direct, stats = asyncio.run(run_on(frames))
        assert [r.outcome for r in results] == ["completed"] * 10, results
        assert all(r.bytes_verified == gen_bytes(100, 2) for r in results)
        # Over the channel the error itself; over Ray, Ray's wrapper of it.
        assert isinstance(refused, ParentInFlight) and (frames == "ray" or type(refused) is ParentInFlight), refused
        assert outcome == "completed"
        assert_clean(stats)
        calls = stats["coordinators"]["gen"]["calls"]
        if frames == "stream":
            # The second batch, and the direct duplicate (its first went by
            # Ray call: the channel opens beside it): every one on the channel.
            assert client["submit_channel"] - client["before"]["submit_channel"] == 6, client
            by_ray = client["submit_calls"] + client["submit_batches"]
            assert by_ray == client["before"]["submit_calls"] + client["before"]["submit_batches"], client
            assert direct["submit_channel"] == 1 and direct["submit_calls"] == 1, direct
            assert calls["submit_by_channel"] >= 7, calls
        else:
            assert client["submit_channel"] == 0 and direct["submit_channel"] == 0, (client, direct)
            assert calls.get("submit_by_channel", 0) == 0, calls


def test_a_dead_coordinator_fails_the_submissions_waiting_on_its_channel(ray_cluster: Any) -> None:
    """The GEN coordinator dies with a submission waiting on its channel (its
    handoff held in flight): the submission fails with `ConnectionError` as
    soon as the connection breaks, not at a deadline, and a later one to the
    dead coordinator goes by Ray call and raises Ray's actor error."""
    import ray

    from kvhandoff.actors._submit import SubmitRequest, Submitter
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.cli.harness import held_frames, hold_frames
    from kvhandoff.protocol import Role

    async def scenario() -> tuple[Any, Any, dict]:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=2, pool_blocks=64, round_timeout_s=10.0, control_frames="stream")
        try:
            submitter = Submitter()
            coord = dep.coordinator(Role.GEN)
            warm = ParentKey(request_id="dead-warm", ctx_attempt=1, gen_attempt=1)
            assert await submitter.submit(coord, SubmitRequest(warm, 16, True)) == "completed"
            async with asyncio.timeout(BOUND_S):
                while not submitter.channel_counters["channel_opened"]:
                    await asyncio.sleep(0.01)
            ctx = (await dep.ranks(Role.CTX))[0]
            parent = ParentKey(request_id="dead-held", ctx_attempt=1, gen_attempt=1)
            await hold_frames(ctx, parent.request_id, Role.GEN, 0)
            waiting = submitter.submit(coord, SubmitRequest(parent, 16, True))
            async with asyncio.timeout(BOUND_S):
                while not await held_frames(ctx, parent.request_id, Role.GEN, 0):
                    await asyncio.sleep(0.01)
            ray.kill(coord)
            async with asyncio.timeout(BOUND_S):  # the break, not a deadline, ends it
                lost = (await asyncio.gather(waiting, return_exceptions=True))[0]
                later = (await asyncio.gather(
                    submitter.submit(coord, SubmitRequest(ParentKey(request_id="dead-later", ctx_attempt=1, gen_attempt=1), 16, True)),
                    return_exceptions=True,
                ))[0]
            counters = dict(submitter.counters)
            submitter.close()
            return lost, later, counters
        finally:
            await dep.shutdown()


    lost, later, counters = asyncio.run(scenario())
    assert isinstance(lost, ConnectionError), lost
    assert isinstance(later, ray.exceptions.RayActorError), later
    assert counters["submit_channel"] == 1 and counters["submit_calls"] == 2, counters


def test_kvhandoffs_own_processes_run_with_their_start_up_heap_frozen(ray_cluster: Any) -> None:
    """Each rank actor and coordinator kvhandoff starts froze its start-up
    heap (actors/_heap.py): a full collection of the cyclic GC walks only
    what the process made since, so no handoff waits 100+ ms for one."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.protocol import Role

    from .helpers import inside

    def frozen(self: Any) -> int:
        import gc

        return gc.get_freeze_count()

    async def scenario() -> list[int]:
        dep = await Deployment.launch(ctx_tp=1, gen_tp=1, pool_blocks=16, control_frames="stream")
        try:
            actors = [*(await dep.ranks(Role.CTX)), *(await dep.ranks(Role.GEN))]
            counts = [await inside(a, frozen) for a in actors]
            for role in (Role.CTX, Role.GEN):
                counts.append(await dep.coordinator(role).__ray_call__.remote(frozen))
            return counts
        finally:
            await dep.shutdown()

    counts = asyncio.run(scenario())
    assert len(counts) == 4 and all(n > 10_000 for n in counts), counts
