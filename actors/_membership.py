"""What both fleets (`Fleet`, `EngineFleet`) do to their instances, written
once so a synthetic and an engine instance behave the same:

- `drained`: the instance's coordinator admits nothing more and its own
  rounds end, then every peer rank of the other role lets go of its last
  parent with it (its release). Polled with backoff on
  that observable condition, bounded by the caller's timeout.
- `take_out`: the directory forgets the instance (every peer rank hears
  `peer_left` and unloads its agents), the GEN coordinators drop its handle
  when it is a CTX instance, and its coordinator stops and is killed.
  Every step runs even if an earlier one failed: a dead actor must not keep
  the others from forgetting it.
- `rank_stats`, `coordinator_stats`: every rank's stats, each tagged with
  its instance, and every instance's coordinator stats; a part that does
  not answer gives an error entry instead of failing the call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from kvhandoff.actors._client import stop_actors
from kvhandoff.protocol import Role

__all__ = ["drained", "take_out", "rank_stats", "coordinator_stats"]

async def drained(
    coord: Any, instance_id: str, peers: Callable[[], Awaitable[Sequence[Any]]], timeout: float
) -> bool:
    """True once `coord` drained and no rank of `peers()` (asked after the
    drain) is paired with `instance_id` any more, within `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if not await coord.drain.remote(timeout):
        return False
    others = await peers()
    delay = 0.005
    while sum(await asyncio.gather(*(h.paired_with.remote(instance_id) for h in others))):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(delay)  # a condition we observe, polled with backoff
        delay = min(delay * 2, 0.2)
    return True


async def take_out(
    directory: Any,
    instance_id: str,
    role: Role,
    coord: Any | None,
    gen_coords: Iterable[Any],
    *,
    kill_ranks: bool,
) -> None:
    """Forget `instance_id` everywhere and stop its coordinator (killing the
    ranks it started when `kill_ranks`; an engine's workers are the engine's)."""
    with contextlib.suppress(Exception):
        await directory.remove_instance.remote(instance_id)
    if role is Role.CTX:
        for gen in gen_coords:
            with contextlib.suppress(Exception):
                await gen.forget_peer.remote(instance_id)
    await stop_actors([coord], kill_ranks=kill_ranks)


async def rank_stats(ranks: Sequence[tuple[str, Role, int, Any]]) -> list[dict[str, Any]]:
    """``stats()`` of every (instance name, role, rank, handle) in ``ranks``."""
    answers = await asyncio.gather(*(h.stats.remote() for *_, h in ranks), return_exceptions=True)
    out = []
    for (name, role, rank, _), s in zip(ranks, answers):
        entry = s if isinstance(s, dict) else {"error": repr(s)[:500], "role": role.value, "rank": rank}
        entry["instance"] = name
        out.append(entry)
    return out


async def coordinator_stats(coords: Sequence[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """``stats()`` of every (instance name, coordinator) in ``coords``, by name."""
    answers = await asyncio.gather(*(c.stats.remote() for _, c in coords), return_exceptions=True)
    return {
        name: s if isinstance(s, dict) else {"state": "unreachable", "error": repr(s)[:500]}
        for (name, _), s in zip(coords, answers)
    }
