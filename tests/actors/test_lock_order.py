"""Issue 22 (f): no wait-for cycle, traced on the real handlers.

The deadlock argument (actors/_coordinator.py, "Concurrency inside this
actor"): the one blocking resource of an instance is its coordinator's round
(`_round_lock`, and `_start_lock` while it starts); every client call into a
coordinator may wait for its rounds. While a coordinator holds its round it
awaits only its own ranks (votes, applies, identities) and, on the GEN side,
the peer CTX coordinator's admission (`admit_many` / `claim_many`); a rank
never awaits anything inside the round handlers its coordinator awaits
(`round_vote`, `round_apply`): what it sends from there is fire-and-forget,
owned by `_own`. So the wait-for graph is GEN coordinator -> CTX coordinator
-> ranks, which has no cycle.

This test checks that on a real deployment (two CTX ranks, one GEN rank, real
NIXL, handoffs with client cancels at random moments), not on stubs. A tracer
is put into every coordinator and rank process through Ray's `__ray_call__`
(no hook in the actors): it records every actor call made while the process
holds a round (a context variable set by a wrapper around the coordinator's
locks, and around a rank's round handlers, inherited by the tasks started
there), and which of those calls were handed to `_own` (fire-and-forget; a
coroutine handed to `_own` runs outside the round). Then:

- a coordinator holding its round calls only its own ranks, and the GEN
  coordinator also the CTX coordinator's admission, nothing else;
- a rank inside a round handler makes no call it does not hand to `_own`;
- the graph of those waits has no cycle;
- the calls on a coordinator's channel to its rank (`control_frames=
  "stream"`) count as awaited calls, a rank's report written on it as a
  fire-and-forget one;
- and the trace is not empty: it saw the coordinators' votes and applies,
  the GEN coordinator's `admit_many` and the ranks' reports sent from inside
  `round_apply`, so a wait added on these paths would be seen too.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvhandoff.actors import Deployment
from kvhandoff.protocol import Role

pytestmark = pytest.mark.usefixtures("ray_cluster")

#: What a coordinator may call while it holds its round: its own ranks (any
#: round method), and, from the GEN side only, the CTX coordinator's admission.
PEER_ADMISSION = frozenset({"admit_many", "claim_many"})


def _install(label: str, kind: str) -> Callable[[Any], bool]:
    """A function for `__ray_call__`: put the await tracer into this process
    (once) and wrap this actor's round (a coordinator's locks, a rank's round
    handlers) and its `_own`."""

    def install(obj: Any) -> bool:
        import contextvars
        import inspect
        import sys
        import types

        import ray
        import ray.actor

        state: Any = sys.modules.get("_kvh_await_trace")
        if state is None:
            state = types.ModuleType("_kvh_await_trace")
            state.held = contextvars.ContextVar("kvh_held", default=None)
            state.calls = []
            state.detached = set()
            state.original = ray.actor.ActorMethod._remote

            def _remote(method: Any, *args: Any, **kwargs: Any) -> Any:
                ref = state.original(method, *args, **kwargs)
                holder = state.held.get()
                if holder is not None:
                    ref_id = ref.hex() if isinstance(ref, ray.ObjectRef) else None
                    state.calls.append((holder, method._actor._actor_id.hex(), method._method_name, ref_id))
                return ref

            ray.actor.ActorMethod._remote = _remote
            # The same for what the coordinator's channels carry (control_frames
            # "stream"): a round call a coordinator awaits, a report a rank writes.
            from kvhandoff.actors import _channel

            state.link_call, state.tell = _channel.RankLinks.call, _channel.CallChannel.tell
            state.peer_id = ""

            def link_call(links: Any, rank: int, handle: Any, method: str, *rest: Any) -> Any:
                reply, via = state.link_call(links, rank, handle, method, *rest)
                holder = state.held.get()
                if holder is not None and via == "channel":
                    state.calls.append((holder, handle._actor_id.hex(), method, None))  # awaited
                return reply, via

            def tell(channel: Any, method: str, args: Any) -> bool:
                told = state.tell(channel, method, args)
                holder = state.held.get()
                if told and holder is not None:
                    ref_id = f"tell-{len(state.calls)}"
                    state.detached.add(ref_id)  # a write on a socket: nothing waits for it
                    state.calls.append((holder, state.peer_id, method, ref_id))
                return told

            _channel.RankLinks.call, _channel.CallChannel.tell = link_call, tell  # type: ignore[method-assign]
            sys.modules["_kvh_await_trace"] = state
        target = getattr(obj, "kvhandoff", obj)
        if kind == "rank" and target._find_coordinator():
            state.peer_id = target._coordinator._actor_id.hex()  # whom its channel's reports go to
        own = target._own

        def traced_own(awaitable: Any) -> Any:
            if isinstance(awaitable, ray.ObjectRef):
                state.detached.add(awaitable.hex())
            elif inspect.iscoroutine(awaitable):
                inner = awaitable

                async def outside_the_round() -> Any:
                    state.held.set(None)  # this task's own copy of the context
                    return await inner

                awaitable = outside_the_round()
            return own(awaitable)

        target._own = traced_own
        if kind == "coordinator":

            class TracedLock:
                def __init__(self, inner: Any, name: str) -> None:
                    self.inner = inner
                    self.name = name
                    self.tokens: list[Any] = []

                async def __aenter__(self) -> None:
                    await self.inner.acquire()
                    self.tokens.append(state.held.set(self.name))

                async def __aexit__(self, *exc: Any) -> None:
                    state.held.reset(self.tokens.pop())
                    self.inner.release()

                def __getattr__(self, name: str) -> Any:
                    return getattr(self.inner, name)

            target._round_lock = TracedLock(target._round_lock, f"{label}:round")
            target._start_lock = TracedLock(target._start_lock, f"{label}:start")
        else:
            for name in ("round_vote", "round_apply"):
                original = getattr(target, name)

                def wrap(original: Any = original, name: str = name) -> Any:
                    async def traced(*args: Any, **kwargs: Any) -> Any:
                        state.held.set(f"{label}:{name}")  # this call's task only
                        return await original(*args, **kwargs)

                    return traced

                setattr(target, name, wrap())
        return True

    return install


def _collect(kind: str) -> Callable[[Any], dict[str, Any]]:
    """A function for `__ray_call__`: what the tracer saw here; takes it out."""

    def collect(obj: Any) -> dict[str, Any]:
        import sys

        import ray.actor

        from kvhandoff.actors import _channel

        state: Any = sys.modules.pop("_kvh_await_trace")
        ray.actor.ActorMethod._remote = state.original
        _channel.RankLinks.call, _channel.CallChannel.tell = state.link_call, state.tell
        target = getattr(obj, "kvhandoff", obj)
        del target._own
        if kind == "coordinator":
            target._round_lock = target._round_lock.inner
            target._start_lock = target._start_lock.inner
        else:
            del target.round_vote, target.round_apply
        return {"calls": list(state.calls), "detached": set(state.detached)}

    return collect


def _cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """A cycle of the directed graph `edges`, or None."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


@pytest.mark.parametrize("carrier", ["stream", "ray"])
def test_no_handler_waits_in_a_cycle_on_the_real_actors(carrier: str) -> None:
    """With either frame carrier: a stream's connection opens (its address
    asked by Ray call) in a task the rank owns, as a frame call is one; with
    streams, the round calls and reports the trace sees are those on the
    coordinators' channels."""

    async def scenario() -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=64, transfer_timeout_s=5.0, control_frames=carrier
        )
        try:
            actors: dict[str, tuple[Any, str]] = {
                "coord-ctx": (dep.coordinator(Role.CTX), "coordinator"),
                "coord-gen": (dep.coordinator(Role.GEN), "coordinator"),
            }
            for role in (Role.CTX, Role.GEN):
                for i, handle in enumerate(await dep.ranks(role)):
                    actors[f"{role.value}{i}"] = (handle, "rank")
            names = {handle._actor_id.hex(): name for name, (handle, _) in actors.items()}
            for name, (handle, kind) in actors.items():
                assert await handle.__ray_call__.remote(_install(name, kind))
            rng = random.Random(7)

            async def one(i: int) -> str:
                request = f"lock-{i}"
                task = asyncio.ensure_future(dep.handoff(request, rng.choice((16, 64)), timeout=60.0))
                if rng.random() < 0.4:
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
                    await dep.cancel(request)
                return (await task).outcome

            for batch in range(4):
                outcomes = await asyncio.gather(*(one(batch * 8 + i) for i in range(8)))
                assert set(outcomes) <= {"completed", "cancelled"}, outcomes
            traces = {
                name: await handle.__ray_call__.remote(_collect(kind)) for name, (handle, kind) in actors.items()
            }
            return names, traces
        finally:
            await dep.shutdown()

    names, traces = asyncio.run(scenario())
    edges: set[tuple[str, str]] = set()
    seen: set[tuple[str, str, str]] = set()  # (caller, callee, method) under a round
    wrong: list[str] = []
    for caller, trace in traces.items():
        for holder, callee_id, method, ref in trace["calls"]:
            callee = names.get(callee_id, f"unknown:{callee_id[:8]}")
            if caller.startswith("coord"):
                if ref in trace["detached"]:
                    continue
                seen.add((caller, callee, method))
                own_rank = callee[:3] == caller[-3:]
                peer_admission = caller == "coord-gen" and callee == "coord-ctx" and method in PEER_ADMISSION
                if not (own_rank or peer_admission):
                    wrong.append(f"{holder} calls {callee}.{method}")
                edges.add((caller, callee))
            elif ref not in trace["detached"]:
                wrong.append(f"{holder} calls {callee}.{method} and does not hand it to _own")
                edges.add((caller, callee))
            else:
                seen.add((caller, callee, method))
    assert wrong == [], wrong
    assert _cycle(edges) is None, _cycle(edges)
    # The trace saw the round's waits: it would see a new one on these paths.
    assert ("coord-gen", "coord-ctx", "admit_many") in seen, sorted(seen)
    for coord, ranks in (("coord-ctx", ("ctx0", "ctx1")), ("coord-gen", ("gen0",))):
        for rank in ranks:
            assert (coord, rank, "round_apply") in seen, sorted(seen)
            assert (coord, rank, "round_vote") in seen, sorted(seen)
    # ... and the ranks' sends from inside their round handlers (their reports
    # to the coordinator that awaits them: handed to `_own`, never awaited).
    assert {c for c, callee, m in seen if m == "report" and callee.startswith("coord")} >= {"ctx0", "ctx1"}, sorted(seen)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({("coord-gen", "coord-ctx"), ("coord-ctx", "ctx0")}) is None
    assert _cycle({("coord-gen", "coord-ctx"), ("coord-ctx", "ctx0"), ("ctx0", "coord-gen")}) == [
        "coord-ctx",
        "ctx0",
        "coord-gen",
        "coord-ctx",
    ]
