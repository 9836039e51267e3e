"""Submissions batched per coordinator: `Submitter`, `SubmitRequest`, `SubmitAnswer`.

Theory of operation
-------------------
A Ray actor call costs both processes most of a millisecond of CPU on a busy
host, whatever it carries (docs/design.md "Submissions in batches"); one
call per handoff made the client's `submit` the largest single cost of a
small handoff, at the client and at the GEN coordinator alike. A client
with many handoffs in flight submits them together instead:

- **Batch.** The submissions a client makes to one coordinator in one turn
  of its event loop go in one call, `submit_many`, sent at the end of that
  turn. Nothing waits for a batch to fill or for an earlier one to return:
  a lone submission goes at once, as the plain `submit` call.
- **Answers.** `submit_many` is a Ray streaming generator: at each decision
  that ends some of the batch's handoffs, the coordinator yields their
  answers, and each caller's future is resolved as its answer comes. A
  small handoff never waits for a big one of the same batch.
- **Refusals.** Each request is checked and queued on its own. One that
  `submit` would refuse (a bad request, a parent already in flight, a
  draining instance) is answered with that error, which its caller's
  future raises; the others of the batch go on.
- **Loss.** If the call fails (the coordinator died), every caller of the
  batch not yet answered gets the call's error, as its own `submit` call
  would have raised it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

from kvhandoff.protocol import ParentKey

__all__ = ["SubmitAnswer", "SubmitRequest", "Submitter"]


class SubmitRequest(NamedTuple):
    """One handoff of a `submit_many` batch: the arguments of `submit`."""

    parent: ParentKey
    num_tokens: int
    release_when_ready: bool = False
    blocks: tuple[int, ...] = ()
    peer_instance: str = ""


class SubmitAnswer(NamedTuple):
    """The answer to request `index` of a batch: its outcome, or the error
    its own `submit` would have raised."""

    index: int
    outcome: str | None = None
    error: BaseException | None = None


Spawn = Callable[[Coroutine[Any, Any, None]], Any]


class Submitter:
    """A client's submissions, batched per coordinator (module docstring).

    `spawn(coroutine)` runs a task the client owns (its shutdown cancels it;
    without one, the submitter keeps its tasks itself); `counters` counts
    calls and requests, for the client's stats."""

    def __init__(self, spawn: Spawn | None = None) -> None:
        self._spawn: Spawn = spawn or self._keep
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[Any, list[tuple[SubmitRequest, asyncio.Future[str]]]] = {}
        self.counters = {"submit_calls": 0, "submit_batches": 0, "submitted": 0}

    def submit(self, coordinator: Any, request: SubmitRequest) -> asyncio.Future[str]:
        """Submit `request` to `coordinator` (a GEN coordinator's actor
        handle); the future is its outcome, or raises what `submit` raises."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # A caller that stopped waiting (a timeout over a shield) leaves its
        # future's error unread: read here, so asyncio does not log it.
        future.add_done_callback(_read_error)
        batch = self._pending.get(coordinator)
        if batch is None:
            batch = self._pending[coordinator] = []
            asyncio.get_running_loop().call_soon(self._flush, coordinator)
        batch.append((request, future))
        self.counters["submitted"] += 1
        return future

    def _keep(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _flush(self, coordinator: Any) -> None:
        batch = self._pending.pop(coordinator, [])
        if len(batch) == 1:
            self.counters["submit_calls"] += 1
            self._spawn(_one(coordinator, *batch[0]))
        elif batch:
            self.counters["submit_batches"] += 1
            self._spawn(_many(coordinator, batch))


def _read_error(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()


async def _one(coordinator: Any, request: SubmitRequest, future: asyncio.Future[str]) -> None:
    try:
        outcome = await coordinator.submit.remote(*request)
    except asyncio.CancelledError:  # the client is shutting down
        future.cancel()
        raise
    except Exception as exc:
        if not future.done():
            future.set_exception(exc)
    else:
        if not future.done():
            future.set_result(str(outcome))


async def _many(coordinator: Any, batch: list[tuple[SubmitRequest, asyncio.Future[str]]]) -> None:
    futures = [future for _, future in batch]
    try:
        async for ref in coordinator.submit_many.remote([request for request, _ in batch]):
            for answer in await ref:
                future = futures[answer.index]
                if future.done():
                    continue  # its caller stopped waiting
                if answer.error is not None:
                    future.set_exception(answer.error)
                else:
                    future.set_result(str(answer.outcome))
    except asyncio.CancelledError:  # the client is shutting down
        for future in futures:
            future.cancel()
        raise
    except Exception as exc:
        for future in futures:
            if not future.done():
                future.set_exception(exc)
    else:
        error = RuntimeError("submit_many ended without answering every request")
        for future in futures:
            if not future.done():
                future.set_exception(error)
