"""The host of a rank endpoint: `EndpointHost` (a mixin for a Ray actor class
that holds a rank core and forwards `ENDPOINT_METHODS` to it on the
endpoint's own event loop), `endpoint_actor`, and
kvhandoff's own rank actor classes (`CtxRankActor`, `GenRankActor`,
`rank_actor_class`, `RankActor`).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import ray

from kvhandoff.actors._heap import freeze_startup_heap
from kvhandoff.actors.rank._config import RankConfig
from kvhandoff.actors.rank._core import RankCore
from kvhandoff.actors.rank._ctx import CtxRankCore
from kvhandoff.actors.rank._gen import GenRankCore
from kvhandoff.protocol import Role


def _remote_methods() -> tuple[str, ...]:
    names: set[str] = set()
    for cls in (CtxRankCore, GenRankCore):
        for name, _member in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if not name.startswith("_"):
                names.add(name)
    return tuple(sorted(names))


#: The methods an `EndpointHost` forwards to its endpoint (what peers,
#: coordinators, the directory and clients call on a rank's actor handle).
ENDPOINT_METHODS = _remote_methods()


#: The Ray concurrency group an endpoint's methods run in: its own event loop
#: (its own thread), whatever the host actor does on its default loop.
ENDPOINT_GROUP = "kvhandoff"
#: At most this many endpoint calls run at once (Ray's default for an async actor).
ENDPOINT_CONCURRENCY = 1000


class EndpointHost:
    """Mixin for a Ray actor class that hosts a rank endpoint in ``self.kvhandoff``.

    The host constructs the endpoint in its ``__init__`` (which registers it
    with the deployment's directory, naming this actor as its handle) and
    keeps it for the actor's lifetime. Every name in `ENDPOINT_METHODS` is an
    async method of the host that forwards to the endpoint, in the Ray
    concurrency group `ENDPOINT_GROUP`: the endpoint lives on that group's
    event loop. The host must still never block its own default loop: run
    a forward pass or an engine step on a thread (Ray stops dispatching to
    every group of an async actor once a call queues behind a blocked loop
    that a call just returned from; docs/design.md). Make the class an
    actor with `endpoint_actor` (or declare the group in ``ray.remote``'s
    ``concurrency_groups`` yourself)."""

    kvhandoff: RankCore


#: The endpoint hosts of this process, by their actor's id (hex), from the
#: first call forwarded to each: a client in the same process (an engine's
#: own front end calling its decode rank) reaches the endpoint on its loop
#: instead of through Ray (`hosted_here`).
_HOSTED: dict[str, EndpointHost] = {}


def hosted_here(handle: Any) -> tuple[RankCore, asyncio.AbstractEventLoop] | None:
    """The endpoint behind rank actor ``handle`` and the loop its state lives
    on, if that actor is hosted in this process and has served a call;
    else None (call it through Ray)."""
    actor_id = getattr(handle, "_actor_id", None)
    host = _HOSTED.get(actor_id.hex()) if actor_id is not None and _HOSTED else None
    if host is None:
        return None
    endpoint = host.kvhandoff
    loop = getattr(endpoint, "_home", None)
    if loop is None or loop.is_closed():
        return None
    return endpoint, loop


def endpoint_loop(host: EndpointHost) -> asyncio.AbstractEventLoop | None:
    """The loop ``host``'s endpoint lives on, once it has served a call
    (None before, or once that loop closed): code of the same process that
    runs there (an engine's own receive beside its decode rank) reaches the
    endpoint with no thread hop."""
    loop = getattr(getattr(host, "kvhandoff", None), "_home", None)
    return None if loop is None or loop.is_closed() else loop


def _seen_on(host: EndpointHost, loop: asyncio.AbstractEventLoop) -> None:
    """Record the loop ``host``'s endpoint lives on, and the host in
    `_HOSTED`. A module function: Ray ships a forwarder by value, with a
    copy of the globals it names (a copied dict would register nothing)."""
    host.kvhandoff._home = loop
    actor_id = ray.get_runtime_context().get_actor_id()
    if actor_id is not None:
        _HOSTED[actor_id] = host


def _forwarder(name: str) -> Any:
    async def forward(self: EndpointHost, *args: Any, **kwargs: Any) -> Any:
        endpoint = self.kvhandoff
        # The loop its state lives on: kvhandoff.cli.harness.on_endpoint_loop
        # (the test harness) and a client in this process run code there.
        loop = asyncio.get_running_loop()
        if getattr(endpoint, "_home", None) is not loop:
            _seen_on(self, loop)
        return await getattr(endpoint, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Forwarded to the hosted endpoint's `{name}`."
    return ray.method(concurrency_group=ENDPOINT_GROUP)(forward)


for _name in ENDPOINT_METHODS:
    setattr(EndpointHost, _name, _forwarder(_name))


def endpoint_actor(cls: Any = None, /, **options: Any) -> Any:
    """`ray.remote` for a class that mixes in `EndpointHost`: the same
    options, plus the endpoint's concurrency group. Use as ``@endpoint_actor``
    or ``@endpoint_actor(num_gpus=1)``."""

    def make(klass: Any) -> Any:
        if not issubclass(klass, EndpointHost):
            raise TypeError(f"{klass.__name__} does not mix in EndpointHost")
        groups = {**options.get("concurrency_groups", {}), ENDPOINT_GROUP: ENDPOINT_CONCURRENCY}
        return ray.remote(**{**options, "concurrency_groups": groups})(klass)

    return make(cls) if cls is not None else make


class _CtxRankHost(EndpointHost):
    """kvhandoff's own CTX rank actor: a host of a `CtxRankCore` over memory
    it allocates (the synthetic path)."""

    def __init__(self, config: RankConfig, epoch: int) -> None:
        self.kvhandoff = CtxRankCore(config, epoch)
        freeze_startup_heap()  # its own process: no full collection walks start-up's objects


class _GenRankHost(EndpointHost):
    """kvhandoff's own GEN rank actor: a host of a `GenRankCore`."""

    def __init__(self, config: RankConfig, epoch: int) -> None:
        self.kvhandoff = GenRankCore(config, epoch)
        freeze_startup_heap()


CtxRankActor = endpoint_actor(num_cpus=0)(_CtxRankHost)
GenRankActor = endpoint_actor(num_cpus=0)(_GenRankHost)
_ACTOR_CLASSES = {Role.CTX: CtxRankActor, Role.GEN: GenRankActor}


def rank_actor_class(role: Role) -> Any:
    """The Ray actor class of a rank of `role`."""
    return _ACTOR_CLASSES[role]


class _RankActor:
    """`RankActor.options(**options).remote(config, epoch)`: a rank actor of
    the class `config.spec.role` names, created like any Ray actor class."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self._options = dict(options or {})

    def options(self, **options: Any) -> _RankActor:
        return _RankActor({**self._options, **options})

    def remote(self, config: RankConfig, epoch: int) -> Any:
        return rank_actor_class(config.spec.role).options(**self._options).remote(config, epoch)


RankActor = _RankActor()

