"""What every client handle shares (`Deployment`, `Fleet`, `EngineDeployment`,
`EngineFleet`): its lifecycle, written once.

A handle is open until `shutdown()`. The tasks it starts (`_spawn`) are its
own: shutdown cancels them and waits for them. Then the coordinators it
started each get a bounded chance to stop their rounds (and the rank actors
they started, unless the ranks are an engine's workers: `_kills_ranks`),
and they and the directory are killed (`stop_actors`). Every call on a
closed handle raises `DeploymentClosed`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import ray

from kvhandoff.actors._errors import DeploymentClosed
from kvhandoff.actors._instance import _ref
from kvhandoff.actors._launch import cancel_tasks
from kvhandoff.actors._submit import Submitter

__all__ = ["ClientCore", "stop_actors"]

T = TypeVar("T")

#: How long a coordinator gets to stop before it is killed.
SHUTDOWN_S = 10.0


async def stop_actors(coords: Iterable[Any], directory: Any = None, *, kill_ranks: bool) -> None:
    """Give each coordinator in `coords` a bounded chance to stop (killing the
    ranks it started when `kill_ranks`), then kill them and `directory`.
    Every step runs even if another failed: a dead actor stops nothing."""
    coords = [c for c in coords if c is not None]
    await asyncio.gather(
        *(asyncio.wait_for(_ref(c.shutdown.remote(kill_ranks)), SHUTDOWN_S) for c in coords),
        return_exceptions=True,
    )
    for handle in [*coords, directory]:
        if handle is not None:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)


class ClientCore:
    """The lifecycle of a client handle (module docstring)."""

    name: str
    _directory: Any
    #: Whether the coordinators kill the rank actors they started when they
    #: stop: an engine's workers, and the endpoints they host, are the engine's.
    _kills_ranks = True

    def __init__(self) -> None:
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._directory = None
        # Submissions to a coordinator, batched per turn of the loop (`_submit`).
        self._submitter = Submitter(self._spawn)

    @property
    def closed(self) -> bool:
        """True once `shutdown()` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise DeploymentClosed(self.name)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A task the handle owns: kept until done, cancelled by shutdown()."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shutdown(self) -> None:
        """Stop (idempotent): calls still in flight end (they raise
        `DeploymentClosed`), then the coordinators this handle started stop
        (with the rank actors they started; an engine's workers are the
        engine's to stop) and are killed with the directory. Every later
        call raises `DeploymentClosed`."""
        if self._closed:
            return
        self._closed = True
        self._submitter.close()
        await cancel_tasks(self._tasks)
        await self._teardown()

    def _coordinators(self) -> list[Any]:
        """The coordinators this handle started (shutdown stops them)."""
        return []

    async def _teardown(self) -> None:
        await stop_actors(self._coordinators(), self._directory, kill_ranks=self._kills_ranks)
