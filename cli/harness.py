"""Cancel a handoff at one exact phase: the test harness (`kvhandoff.cli.harness`).

The tests, the chaos demo, the benchmarks and the engine example use it to
place a cancel where a serving engine's own would land only by chance. It
is a tool, apart from the runtime: no runtime module imports it, and the
runtime API has no hook for it.

`Deployment.handoff` is one submission the ranks drive on their own, so there
is no client step to cancel "between". To reach a phase exactly, this harness
arranges the real rank actors' internals through Ray's ``__ray_call__`` (no
hook in any public signature), submits, waits on an observable condition, and
cancels:

- "before_open": both instances admitted, no OPEN sent yet. Every GEN rank
  defers installing this request (its `_open`), the cancel is decided in both
  instances, then the deferred installs run and find nothing to open;
- "before_ready": OPENs sent, but the OPENs to the last CTX rank are held on
  every GEN rank, so no CTX round can decide the request; cancel in both
  instances, then deliver the held frames (in order);
- "mid_dma": cancel once a CTX rank posted a chunk of the request (with a
  `FaultPlan` that defers completions, DMA is genuinely in flight);
- "after_complete": cancel after the handoff completed (a no-op).

"before_open" and "before_ready" hold OPENs or frames in the ranks' fault
state (actors/_faults.py): a rank launched with a `FaultPlan` is built with
one; on any other rank the harness installs one when it first holds.

Waits poll one observable condition (1 ms between polls), never a guessed
duration; every wait is bounded by the handoff's own timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvhandoff.actors._faults import DirectoryFaults, RankFaults
from kvhandoff.protocol import ParentKey, Role
from kvhandoff.topology import shard_map

__all__ = [
    "on_endpoint_loop",
    "CANCEL_PHASES",
    "handoff_cancel_at",
    "until_posted",
    "delay_lookups",
    "hold_frames",
    "release_frames",
    "held_frames",
    "defer_opens",
    "deferred_opens",
    "run_deferred_opens",
    "hold_decisions",
    "held_decisions",
    "release_decisions",
]

#: The exact phases `handoff_cancel_at` knows (None: no cancel).
CANCEL_PHASES = (None, "before_open", "before_ready", "mid_dma", "after_complete")
_ENDED = ("released", "quarantined", "decode_ready", "settled", "completed", "cancelled", "rejected", "failed")


def on_endpoint_loop(host: Any, fn: Any, *args: Any) -> Any:
    """Run ``fn(endpoint, *args)`` on the loop the hosted endpoint lives on
    (for code that reaches an endpoint's internals through Ray's
    ``__ray_call__``, which runs on the host's default loop: the test
    harness). Waits for the answer."""
    endpoint = getattr(host, "kvhandoff", host)
    home = getattr(endpoint, "_home", None)
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if home is None or home is here or not home.is_running():
        return fn(endpoint, *args)

    async def call() -> Any:
        return fn(endpoint, *args)

    return asyncio.run_coroutine_threadsafe(call(), home).result()


# -- functions that run on a rank endpoint, inside its host actor, on the
# endpoint's own loop (``__ray_call__`` + `on_endpoint_loop`: actors/rank/_host.py) --


def _faults(core: Any) -> RankFaults:
    """The rank's fault state: the one it was built with (a `FaultPlan`), or
    one installed now (a rank built without, e.g. an engine's endpoint)."""
    if core.faults is None:
        core.faults = RankFaults()
    faults: RankFaults = core.faults
    return faults


def _hold(core: Any, request_id: str, role: str, rank: int) -> int:
    _faults(core).frames.setdefault((request_id, role, rank), [])
    return 0


def _count(core: Any, request_id: str, role: str, rank: int) -> int:
    return len(_faults(core).frames.get((request_id, role, rank), ()))


def _release(core: Any, request_id: str, role: str, rank: int, drop: bool) -> int:
    frames = _faults(core).frames.pop((request_id, role, rank), [])
    if not drop:
        for to, frame in frames:
            core._send(to, frame, request_id)
    return len(frames)


def _defer_opens(core: Any, request_id: str) -> int:
    _faults(core).opens[request_id] = []
    return 0


def _deferred(core: Any, request_id: str) -> int:
    return len(_faults(core).opens.get(request_id, ()))


def _run_deferred(core: Any, request_id: str) -> int:
    parents = _faults(core).opens.pop(request_id, [])
    for parent in parents:
        core._open(parent, time.monotonic())
    return len(parents)


class _ReportWatch:
    """Stands in for a rank's coordinator handle: at each report the rank
    pushes, records whether an urgent frame still waited in the rank's
    outbox (`_watch_reports`), and holds the report while ``hold`` is set
    (`_hold_reports`: a report that comes late, in order, once released);
    every other call goes to the real handle."""

    def __init__(self, core: Any, handle: Any) -> None:
        self._core, self._handle = core, handle
        self.frames_waiting: list[bool] = []
        self.hold = False
        self.held: list[Any] = []

    @property
    def report(self) -> _ReportWatch:
        return self

    def remote(self, report: Any) -> Any:
        self.frames_waiting.append(any(box[2] for box in self._core._outbox.values()))
        if self.hold:
            self.held.append(report)
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            done.set_result(True)
            return done
        return self._handle.report.remote(report)

    def release(self) -> int:
        self.hold = False
        held, self.held = self.held, []
        for report in held:
            self._core._own(self._handle.report.remote(report))
        return len(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _report_watch(core: Any) -> _ReportWatch:
    if not isinstance(core._coordinator, _ReportWatch):
        assert core._find_coordinator()
        # Reports take the (watched) Ray call from here on, not the channel.
        core._take_channel = lambda channel: None
        core._coordinator_channel = None
        core._coordinator = _ReportWatch(core, core._coordinator)
    watch: _ReportWatch = core._coordinator
    return watch


def _watch_reports(core: Any) -> int:
    _report_watch(core)
    return 0


def _hold_reports(core: Any) -> int:
    _report_watch(core).hold = True
    return 0


def _release_reports(core: Any) -> int:
    """Send the held reports, in order; returns how many."""
    return _report_watch(core).release()


def _reports_with_frames_waiting(core: Any) -> list[bool]:
    """Per report pushed since `_watch_reports`: whether a frame on a
    handoff's path waited behind it."""
    watch: _ReportWatch = core._coordinator
    return list(watch.frames_waiting)


# -- functions that run inside a coordinator actor (``__ray_call__``) --


class _DecisionHold:
    """Stands in for a coordinator's handle to one rank: while held, the
    round calls sent to the rank (applies and votes: a decision rides a
    vote too, and a rank takes rounds only in order) wait, in order, until
    released, as they would behind a slow rank's loop (`hold_decisions`);
    every other call goes to the real handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.held = 0
        self.flowing = asyncio.Event()
        self.flowing.set()
        #: The coordinator's loop (``__ray_call__`` may run on another thread).
        self.loop: asyncio.AbstractEventLoop | None = None

    def __getattr__(self, name: str) -> Any:
        if name not in ("round_apply", "round_vote"):
            return getattr(self.handle, name)
        hold = self

        class _Method:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future[Any]:
                return asyncio.ensure_future(hold.call(name, *args))

        return _Method

    async def call(self, name: str, *args: Any) -> Any:
        self.loop = asyncio.get_running_loop()
        if not self.flowing.is_set():
            self.held += 1
            await self.flowing.wait()
        return await getattr(self.handle, name).remote(*args)


def _decision_hold(core: Any, rank: int) -> _DecisionHold:
    if not isinstance(core._handles[rank], _DecisionHold):
        core._handles[rank] = _DecisionHold(core._handles[rank])
    hold: _DecisionHold = core._handles[rank]
    return hold


def _hold_decisions(core: Any, rank: int) -> int:
    hold = _decision_hold(core, rank)
    hold.held = 0
    hold.flowing.clear()
    return 0


def _held_decisions(core: Any, rank: int) -> int:
    return _decision_hold(core, rank).held


def _release_decisions(core: Any, rank: int) -> int:
    hold = _decision_hold(core, rank)
    if hold.loop is not None:
        hold.loop.call_soon_threadsafe(hold.flowing.set)
    else:
        hold.flowing.set()
    return hold.held


async def hold_decisions(coordinator: Any, rank: int) -> None:
    """From now on, the round calls `coordinator` sends its rank `rank` (its
    decisions: applies, and votes they ride) wait; keep the hold under the
    round bound, or the watchdog takes the rank for failed."""
    await coordinator.__ray_call__.remote(_hold_decisions, rank)


async def held_decisions(coordinator: Any, rank: int) -> int:
    """How many round calls to rank `rank` waited since `hold_decisions`."""
    return int(await coordinator.__ray_call__.remote(_held_decisions, rank))


async def release_decisions(coordinator: Any, rank: int) -> int:
    """Let the held decisions go, in order; later ones flow again."""
    return int(await coordinator.__ray_call__.remote(_release_decisions, rank))


def _delay_lookups(directory: Any, seconds: float, instance: str | None, count: int | None) -> None:
    if directory.faults is None:
        directory.faults = DirectoryFaults()
    directory.faults.delay(seconds, instance, count)


# -- the harness ------------------------------------------------------------------------


async def delay_lookups(dep: Any, seconds: float, instance: str | None = None, count: int | None = None) -> None:
    """`dep`'s directory answers each `lookup` (of `instance` only, when
    given; the next `count` only, when given) `seconds` late, as a loaded
    directory would; 0 seconds ends it."""
    await dep._directory.__ray_call__.remote(_delay_lookups, seconds, instance, count)


async def hold_frames(rank: Any, request_id: str, role: Role, peer_rank: int) -> None:
    """From now on, frames of `request_id` from `rank` to peer (`role`, `peer_rank`) wait."""
    await rank.__ray_call__.remote(on_endpoint_loop, _hold, request_id, role.value, peer_rank)


async def held_frames(rank: Any, request_id: str, role: Role, peer_rank: int) -> int:
    return int(await rank.__ray_call__.remote(on_endpoint_loop, _count, request_id, role.value, peer_rank))


async def release_frames(rank: Any, request_id: str, role: Role, peer_rank: int, drop: bool = False) -> int:
    """Send the held frames in order (or drop them); later frames flow again."""
    return int(await rank.__ray_call__.remote(on_endpoint_loop, _release, request_id, role.value, peer_rank, drop))


async def defer_opens(rank: Any, request_id: str) -> None:
    """GEN `rank` admits `request_id` but does not install or open it until
    `run_deferred_opens` (a GEN that is slow to open)."""
    await rank.__ray_call__.remote(on_endpoint_loop, _defer_opens, request_id)


async def deferred_opens(rank: Any, request_id: str) -> int:
    return int(await rank.__ray_call__.remote(on_endpoint_loop, _deferred, request_id))


async def run_deferred_opens(rank: Any, request_id: str) -> int:
    """Open what was deferred now (a parent no longer admitted opens nothing)."""
    return int(await rank.__ray_call__.remote(on_endpoint_loop, _run_deferred, request_id))


async def _until(condition: Callable[[], Any], done: asyncio.Future[Any], deadline: float) -> None:
    while time.perf_counter() < deadline and not done.done():
        if await condition():
            return
        await asyncio.sleep(0.001)


async def until_posted(dep: Any, request_id: str, timeout: float, task: asyncio.Task[Any] | None = None) -> None:
    """Until a CTX rank posted a chunk of the current attempt of `request_id`
    or it ended there (or `task` ended, or `timeout` passed). The attempt is
    re-read at every poll: a `handoff` task created just before this call may
    not have begun its attempt yet."""
    ctxs = await dep.ranks(Role.CTX)

    async def posted() -> bool:
        phases = await asyncio.gather(*(h.phase.remote(dep.parent(request_id)) for h in ctxs))
        return any(p["posted"] > 0 for p in phases) or any(p["state"] in _ENDED for p in phases)

    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await _until(posted, task if task is not None else never, time.perf_counter() + timeout)


async def _cancel_both(dep: Any, request_id: str) -> None:
    """Cancel in both instances and wait until both rounds decided it."""
    parent: ParentKey = dep.parent(request_id)
    await dep.cancel(request_id)
    await dep.coordinator(Role.CTX).cancel.remote(parent)


async def handoff_cancel_at(
    dep: Any, request_id: str, num_tokens: int, phase: str | None, *, timeout: float = 60.0
) -> Any:
    """`dep.handoff(request_id, num_tokens)` with a cancel at exactly `phase`."""
    if phase not in CANCEL_PHASES:
        raise ValueError(f"phase must be one of {CANCEL_PHASES}, got {phase!r}")
    if phase is None:
        return await dep.handoff(request_id, num_tokens, timeout=timeout)
    if phase == "after_complete":
        result = await dep.handoff(request_id, num_tokens, timeout=timeout)
        await dep.cancel(request_id)
        return result
    deadline = time.perf_counter() + timeout
    gens = await dep.ranks(Role.GEN)
    ctxs = await dep.ranks(Role.CTX)
    last_ctx = len(ctxs) - 1
    if phase == "before_open":
        await asyncio.gather(*(g.__ray_call__.remote(on_endpoint_loop, _defer_opens, request_id) for g in gens))
    elif phase == "before_ready":
        await asyncio.gather(*(hold_frames(g, request_id, Role.CTX, last_ctx) for g in gens))
    task = asyncio.ensure_future(dep.handoff(request_id, num_tokens, timeout=timeout))
    try:
        if phase == "before_open":

            async def admitted() -> bool:
                counts = await asyncio.gather(*(g.__ray_call__.remote(on_endpoint_loop, _deferred, request_id) for g in gens))
                return all(counts)

            await _until(admitted, task, deadline)
            await _cancel_both(dep, request_id)
            await asyncio.gather(*(g.__ray_call__.remote(on_endpoint_loop, _run_deferred, request_id) for g in gens))
        elif phase == "before_ready":

            # The GEN ranks with an edge to the last CTX rank: each holds its OPEN.
            to_last = {g for _, g in shard_map(dep.layout, len(ctxs), len(gens)).edges_for_ctx_rank(last_ctx)}

            async def opened() -> bool:
                counts = await asyncio.gather(
                    *(held_frames(gens[g], request_id, Role.CTX, last_ctx) for g in sorted(to_last))
                )
                return all(counts)

            await _until(opened, task, deadline)
            await _cancel_both(dep, request_id)
            await asyncio.gather(*(release_frames(g, request_id, Role.CTX, last_ctx) for g in gens))
        else:  # mid_dma
            await until_posted(dep, request_id, deadline - time.perf_counter(), task)
            await dep.cancel(request_id)
    finally:
        # Whatever happened, leave no hold behind on the ranks.
        if phase == "before_open":
            await asyncio.gather(
                *(g.__ray_call__.remote(on_endpoint_loop, _run_deferred, request_id) for g in gens), return_exceptions=True
            )
        elif phase == "before_ready":
            await asyncio.gather(
                *(release_frames(g, request_id, Role.CTX, last_ctx) for g in gens), return_exceptions=True
            )
    return await task
