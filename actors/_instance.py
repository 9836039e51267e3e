"""Starting an instance: its coordinator over its rank hosts, then a wait on
progress until every rank answered and registered.

Every client starts its instances this one way: `Deployment` and `Fleet`
over kvhandoff's own rank actors, `EngineDeployment` and `EngineFleet` over
an engine's workers. The only difference is who hosts the ranks:

- kvhandoff's synthetic hosts: a rank factory the coordinator calls to start
  each rank actor, and calls again to restart one (a new epoch);
- an engine's workers: their handles, each already hosting its endpoint
  (actors/endpoint.py); the engine restarts a worker and re-attaches it.

Either way the coordinator asks each rank for its identity. The wait ends
at once when a rank died while starting (`LaunchFailed` with its death
cause), goes on while ranks are still starting (waiting for resources,
constructing), and is bounded as a whole by the caller's start limit, past
which `LaunchFailed` names every rank that had not started and why. Then
every rank must have registered its endpoint with the directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvhandoff.actors._coordinator import Coordinator, CoordinatorConfig
from kvhandoff.actors._errors import LaunchFailed
from kvhandoff.topology import TopologySpec, topology_digest

__all__ = ["start_coordinator", "await_started", "connected"]


async def _ref(ref: Any) -> Any:
    """Await a Ray ObjectRef as a coroutine (for asyncio.wait / wait_for)."""
    return await ref


def start_coordinator(
    name: str, spec: TopologySpec, hosts: Any, *, options: Mapping[str, Any] | None = None, **settings: Any
) -> Any:
    """Start the coordinator actor `name` of the instance `spec` over its rank
    `hosts`: a sequence of handles (an engine's workers, rank r at index r)
    or a rank factory (kvhandoff's rank actors, started by the coordinator).
    `options` are Ray actor options (placement); `settings` the
    coordinator's own (`CoordinatorConfig`: round bound, restarts, peer,
    admission mode), checked here before the actor starts."""
    config = CoordinatorConfig(**settings)
    place = {"ranks": list(hosts)} if isinstance(hosts, Sequence) else {"rank_factory": hosts, "tp": spec.tp}
    return Coordinator.options(name=name, **(options or {})).remote(
        spec.instance_id, topology_digest=topology_digest(spec), config=config, **place
    )


async def await_started(
    deployment: str,
    coords: Mapping[str, Any],
    instances: Mapping[str, str],
    directory: Any,
    timeout_s: float,
) -> None:
    """Wait until every rank of each coordinator in `coords` (keyed by a label
    for messages: "ctx", "gen" or an instance name) answered its identity and
    registered with `directory` under its instance id (`instances`, by the
    same label), within `timeout_s` in all. Raises `LaunchFailed` (module
    docstring); the caller stops what it started."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # `epochs` answers once every rank of the instance answered its identity;
    # a rank that died while starting makes it raise at once (TopologyFailed
    # naming the rank and its death cause). A rank still starting is no error.
    starts = {label: asyncio.ensure_future(_ref(c.epochs.remote())) for label, c in coords.items()}
    try:
        done, pending = await asyncio.wait(starts.values(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:  # a rank died while starting, or a coordinator did
                cause = getattr(error, "cause", None) or error
                died = {k: v for k, v in (await _not_started(coords)).items() if "died" in v}
                raise LaunchFailed(deployment, str(getattr(cause, "reason", cause)), died) from error
        if pending:
            not_started = await _not_started(coords)
            raise LaunchFailed(deployment, f"rank actors did not start within {timeout_s:g}s", not_started)
    finally:
        for future in starts.values():
            future.cancel()
    expected = {instances[label]: starts[label].result() for label in coords}
    if not await directory.wait_for.remote(expected, max(deadline - loop.time(), 0.0)):
        raise LaunchFailed(deployment, f"rank actors did not register with the directory within {timeout_s:g}s")


async def connected(deployment: str, ranks: Sequence[Any], timeout_s: float) -> None:
    """Every rank in `ranks` learns its peers' agents and buffers (`connect`),
    within `timeout_s`; else `LaunchFailed`."""
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(h.connect.remote() for h in ranks))
    except TimeoutError:
        raise LaunchFailed(deployment, f"rank actors did not connect to their peers within {timeout_s:g}s") from None


async def _not_started(coords: Mapping[str, Any]) -> dict[str, str]:
    """Per rank that has not answered yet: why, as its coordinator sees it."""
    found: dict[str, str] = {}
    for label, coord in coords.items():
        try:
            status = await asyncio.wait_for(_ref(coord.start_status.remote()), 10.0)
        except Exception as exc:
            found[f"{label} coordinator"] = f"no answer: {exc!r}"[:300]
            continue
        for rank, why in sorted(status.items()):
            if why != "started":
                found[f"{label} rank {rank}"] = why
    return found
