"""Endpoints: the rank logic as an object an engine's own process holds.

Theory of operation (docs/design.md "Engines")
----------------------------------------------
A serving engine keeps its KV tensors in its own worker processes (often its
own Ray actors, next to the model) and its own block manager. kvhandoff's rank
logic (the sans-IO protocol object, the block pool mirror, the NIXL agent with
the engine's tensors registered once, round membership, frames) is a plain
object, a *rank endpoint* (`RankCore`: `CtxRankCore` or `GenRankCore`), which
any Ray actor can host:

    @endpoint_actor                               # ray.remote + the endpoint's group
    class PrefillWorker(EndpointHost):            # the engine's actor
        def __init__(self, plan: EnginePlan, rank: int) -> None:
            self.kv = [torch.zeros(blocks, 2, 16, heads, dim) for _ in range(layers)]
            self.kvhandoff = ctx_endpoint(plan, rank, self.kv)   # registers once

`EndpointHost` gives the hosting actor the methods through which peers,
coordinators and the directory reach the endpoint (`receive_frames`,
`round_vote`, `stats`, ...: every public coroutine method of the endpoint
classes, forwarded to ``self.kvhandoff``), in the Ray concurrency group
"kvhandoff": the endpoint lives on that group's event loop, in its own
thread, apart from the engine's methods on the actor's default loop. Run
the engine's blocking work (a forward pass, a step) on a thread, never on
that loop: Ray stops dispatching to every group of an async actor once a
call queues behind a blocked loop (docs/design.md). `endpoint_actor` is
``ray.remote`` with that group declared. These names are reserved in a host
class; a host that needs one of them for itself overrides it and forwards.
kvhandoff's own rank actors (`CtxRankActor`, `GenRankActor`) are hosts of
exactly this kind, with kvhandoff-allocated memory and the synthetic KV
pattern: every test of the rank actors exercises the path an engine uses.

An engine endpoint (`ctx_endpoint`, `gen_endpoint`) differs from the
synthetic one in three ways, all in its config: the memory is the engine's
tensors (`tensors`, described by a memory kind), admissions lease exactly the
block ids the engine's block manager chose (they travel in the admission), and
the endpoint is not restartable by its coordinator (the engine owns the
process: past the quarantine limit it stops admitting instead). What it does
with bytes is the engine's business: nothing is prefilled, verified or
poisoned by kvhandoff.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvhandoff.actors._config import staging_of
from kvhandoff.actors.rank import (
    ENDPOINT_METHODS,
    CtxRankCore,
    DataPlane,
    EndpointHost,
    GenRankCore,
    RankConfig,
    endpoint_actor,
    endpoint_loop,
)
from kvhandoff.protocol import Role
from kvhandoff.topology import KVLayout, TopologySpec

__all__ = [
    "EndpointHost",
    "endpoint_actor",
    "endpoint_loop",
    "EnginePlan",
    "ctx_endpoint",
    "gen_endpoint",
    "ENDPOINT_METHODS",
]


class EnginePlan(DataPlane, frozen=True, kw_only=True):
    """What every party of an engine deployment shares: its name (the
    directory and coordinators are named after it), both instances' specs,
    the model's KV layout and each side's memory kind (how its tensors hold
    the blocks; docs/design.md "Memory kinds"), and the data-plane and
    timeout settings. `EngineDeployment.create` makes it; the engine passes it
    to its workers, which build their endpoints from it."""

    name: str
    ctx: TopologySpec
    gen: TopologySpec
    layout: KVLayout
    ctx_memory: str = "paged"
    gen_memory: str = "paged"
    chunk_bytes: int = 1 << 20
    lease_timeout_s: float = 30.0
    consume_timeout_s: float = 30.0
    control_frames: str = "stream"
    #: Pull between one-rank instances (`EngineConfig.pull`); a fleet pushes.
    pull: bool = False
    read_spin_s: float = 0.0005  # `EngineConfig.read_spin_s`
    #: An engine fleet's plan (actors/engine_fleet.py): `instance` names the
    #: instance these workers host (its spec is `ctx` or `gen`, the other is
    #: its default peer); the endpoints pair with every instance of the other
    #: role in the fleet's directory. "": a one-pair `EngineDeployment`.
    instance: str = ""

    def spec(self, role: Role) -> TopologySpec:
        return self.ctx if role is Role.CTX else self.gen


def _config(plan: EnginePlan, role: Role, rank: int, tensors: Sequence[torch.Tensor]) -> RankConfig:
    spec, peer = (plan.ctx, plan.gen) if role is Role.CTX else (plan.gen, plan.ctx)
    if plan.instance and spec.instance_id != plan.instance:
        raise ValueError(f"this plan is for instance {plan.instance!r}, a {spec.role.value} instance, not a {role.value} one")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < spec.tp:
        raise ValueError(f"rank must be an int in [0, {spec.tp}), got {rank!r}")
    if not tensors:
        raise ValueError("an engine endpoint needs the engine's KV tensors")
    first = tensors[0]
    return RankConfig(
        deployment=plan.name,
        spec=spec,
        peer_spec=peer,
        layout=plan.layout,
        rank=rank,
        pool_blocks=int(first.shape[0]) if first.dim() > 1 else 1,
        chunk_bytes=plan.chunk_bytes,
        lease_timeout_s=plan.lease_timeout_s,
        consume_timeout_s=plan.consume_timeout_s,
        device=str(first.device),
        synthetic=False,
        frames=plan.control_frames,
        memory_kind=plan.ctx_memory if role is Role.CTX else plan.gen_memory,
        peer_memory_kind=plan.gen_memory if role is Role.CTX else plan.ctx_memory,
        restartable=False,
        **staging_of(plan),
        fleet=bool(plan.instance),
        pull=plan.pull and not plan.instance,
        read_spin_s=plan.read_spin_s,
        coordinator=f"{plan.name}.coord.{plan.instance}" if plan.instance else "",
    )


def _epoch() -> int:
    # A new incarnation of the engine's worker is a new endpoint epoch (its
    # frames and rounds to the old one are stale): microseconds since the
    # Unix epoch grow across restarts of a process and fit the wire's U63.
    return time.time_ns() // 1000


def ctx_endpoint(plan: EnginePlan, rank: int, tensors: Sequence[torch.Tensor]) -> CtxRankCore:
    """The CTX (prefill) endpoint of `rank`, over the engine's KV `tensors`
    (laid out as `plan.ctx_memory` says). Call it inside the hosting actor's
    ``__init__`` (an `EndpointHost`), after `EngineDeployment.create`."""
    return CtxRankCore(_config(plan, Role.CTX, rank, tensors), _epoch(), tensors=tensors)


def gen_endpoint(plan: EnginePlan, rank: int, tensors: Sequence[torch.Tensor]) -> GenRankCore:
    """The GEN (decode) endpoint of `rank`, over the engine's KV `tensors`."""
    return GenRankCore(_config(plan, Role.GEN, rank, tensors), _epoch(), tensors=tensors)
