"""`Deployment`: the client API (used by the CLI, the Ray job and the notebook).

A deployment is one CTX instance and one GEN instance of rank actors, one
coordinator per instance, and a directory where ranks find each other:

    dep = await Deployment.launch(ctx_tp=2, gen_tp=1)
    result = await dep.handoff("req-1", num_tokens=100)   # admit → ... → decode-ready
    await dep.cancel("req-2")                               # at any moment
    print(await dep.stats()); await dep.shutdown()

`SyncDeployment` wraps it for scripts (`Deployment.launch_sync(...)`).

One handoff (DESIGN.md "Lifecycle"):
1. CTX admission round: every CTX rank leases blocks and prefills them with the
   request's pattern (actors/_pattern.py); concurrently,
2. GEN admission round: every GEN rank leases blocks. The round's apply phase
   finishing on every rank is the installation barrier.
3. Each GEN rank installs the session and sends OPEN on each of its edges; a
   CTX rank that has every edge of the parent prepared reports it, and the CTX
   round that sees every rank prepared decides the parent: READY, then DMA in
   chunks, then TERMINAL(COMPLETED); the GEN rank answers RECEIPT.
4. Each GEN rank verifies every byte of its shard (S2); the GEN completion round
   (intersection) makes the request decode-ready; the CTX completion round
   releases the CTX blocks exactly once. The client then frees the GEN blocks.
Cancellation enters as a cancel in both instances' next rounds; every rank then
drains, proves NOT_STARTED, or quarantines (UNKNOWN), per the protocol layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
import ray

from kvhandoff.actors._coordinator import AdmissionStopped, Coordinator, CoordinatorError
from kvhandoff.actors._dataplane import FaultPlan
from kvhandoff.actors._directory import Directory
from kvhandoff.actors.rank import RankActor, RankConfig
from kvhandoff.protocol import Endpoint, MemoryKind, ParentKey, Role
from kvhandoff.topology import KVLayout, TopologySpec, qualify_pair, topology_digest

__all__ = ["Deployment", "SyncDeployment", "HandoffResult", "DEFAULT_LAYOUT", "CANCEL_PHASES"]

#: Phases at which `handoff(cancel_at=...)` injects a cancel (None: no cancel).
CANCEL_PHASES = (None, "before_open", "before_ready", "mid_dma", "after_complete")
_ENDED = ("released", "quarantined", "decode_ready", "settled", "completed", "cancelled")

T = TypeVar("T")

#: A small model-like layout for host-memory demos: 4 layers, 8 KV heads of 64
#: fp16 dims, 16 tokens per block (128 KiB per block at TP=1).
DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="float16", tokens_per_block=16)


class HandoffResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one handoff ended as."""

    request_id: str
    outcome: str  # completed | cancelled | rejected | failed | timeout
    bytes_verified: int = 0
    latency_s: float = 0.0
    ctx_outcomes: tuple[str, ...] = ()
    gen_outcomes: tuple[str, ...] = ()


class _RankFactory:
    """Picklable `(rank, epoch) -> handle` for the coordinator (creates and restarts ranks)."""

    def __init__(self, configs: list[RankConfig], resources: list[dict[str, Any]]) -> None:
        self.configs = configs
        self.resources = resources
        self._made: set[int] = set()  # ranks this factory (the coordinator's copy) created

    def __call__(self, rank: int, epoch: int) -> Any:
        handle = RankActor.options(**self.resources[rank]).remote(self.configs[rank], epoch)
        if rank in self._made:
            # A restart: learn the peers' agents and buffers now (calls from one
            # caller run in order: after __init__ registered it), not on the
            # first OPEN. Fire-and-forget; a lookup on first use still covers it.
            handle.connect.remote()
        self._made.add(rank)
        return handle

    def retired(self, rank: int, epoch: int) -> None:
        """The coordinator killed `rank`'s incarnation `epoch`: have the directory
        tell the peer instance's ranks now (fire-and-forget)."""
        config = self.configs[rank]
        directory = ray.get_actor(f"{config.deployment}.directory")
        directory.retire.remote(config.spec.role.value, rank, epoch)


class Deployment:
    """A CTX instance and a GEN instance with their coordinators (async API)."""

    def __init__(self) -> None:
        self.name = ""
        self.ctx_spec: TopologySpec
        self.gen_spec: TopologySpec
        self.layout = DEFAULT_LAYOUT
        self.qualified = True
        self.unqualified_reasons: tuple[str, ...] = ()
        self._coords: dict[Role, Any] = {}
        self._directory: Any = None
        self._attempts: dict[str, int] = {}
        self._cancelled: set[ParentKey] = set()  # attempts a client asked to cancel (bounded below)
        # Rank handles and CTX endpoints change only when a rank restarts (a new
        # epoch): cached, keyed by both coordinators' epochs, refreshed off the
        # critical path (concurrently with the admission rounds).
        self._view_epochs: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._view: tuple[dict[Role, list[Any]], list[Endpoint]] | None = None

    # -- launch ---------------------------------------------------------------------

    @classmethod
    async def launch(
        cls,
        *,
        ctx_tp: int = 2,
        gen_tp: int = 1,
        layout: KVLayout | None = None,
        pool_blocks: int = 64,
        memory: str = "DRAM",
        chunk_bytes: int = 256 << 10,
        transfer_timeout_s: float = 10.0,
        lease_timeout_s: float = 30.0,
        round_timeout_s: float = 5.0,
        max_restarts: int = 3,
        start_timeout_s: float = 60.0,
        fault_plan: FaultPlan | None = None,
        synthetic: bool = True,
        prepared_descriptors: bool = True,
        ctx_overrides: dict[str, Any] | None = None,
        gen_overrides: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> Deployment:
        """Start the actors on the current Ray cluster (`ray.init()` it first, or
        let this call start a local one)."""
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self = cls()
        self.name = name or f"kvh-{uuid.uuid4().hex[:8]}"
        self.layout = layout or DEFAULT_LAYOUT
        mem = MemoryKind(memory)
        common = {"memory": mem, "transfer_timeout_s": transfer_timeout_s}
        self.ctx_spec = TopologySpec(instance_id=f"{self.name}-ctx", role=Role.CTX, tp=ctx_tp, **common, **(ctx_overrides or {}))
        self.gen_spec = TopologySpec(instance_id=f"{self.name}-gen", role=Role.GEN, tp=gen_tp, **common, **(gen_overrides or {}))
        verdict = qualify_pair(self.ctx_spec, self.gen_spec)
        self.qualified = verdict.qualified
        self.unqualified_reasons = verdict.reasons
        device = "cuda" if mem is MemoryKind.VRAM else "cpu"
        self._directory = Directory.options(name=f"{self.name}.directory").remote()
        for spec, peer in ((self.ctx_spec, self.gen_spec), (self.gen_spec, self.ctx_spec)):
            configs = [
                RankConfig(
                    deployment=self.name,
                    spec=spec,
                    peer_spec=peer,
                    layout=self.layout,
                    rank=r,
                    pool_blocks=pool_blocks,
                    chunk_bytes=chunk_bytes,
                    lease_timeout_s=lease_timeout_s,
                    device=device,
                    fault_plan=fault_plan if spec.role is Role.CTX else None,
                    conservative=not self.qualified,
                    synthetic=synthetic,
                    prepared_descriptors=prepared_descriptors,
                )
                for r in range(spec.tp)
            ]
            resources = [
                {"num_cpus": 0, "num_gpus": 1 if device == "cuda" else 0} for _ in range(spec.tp)
            ]
            self._coords[spec.role] = Coordinator.options(name=f"{self.name}.coord.{spec.role.value}").remote(
                spec.instance_id,
                rank_factory=_RankFactory(configs, resources),
                tp=spec.tp,
                round_timeout=round_timeout_s,
                max_restarts=max_restarts,
                restart_timeout=start_timeout_s,
                topology_digest=topology_digest(spec),
            )
        epochs = await asyncio.gather(*(c.epochs.remote() for c in self._coords.values()))
        expected = {role.value: e for role, e in zip(self._coords, epochs)}
        if not await self._directory.wait_for.remote(expected, 60.0):
            raise CoordinatorError(f"{self.name}: rank actors did not register in time")
        await asyncio.gather(*(h.connect.remote() for h in await self._all_ranks()))
        return self

    @classmethod
    def launch_sync(cls, **kwargs: Any) -> SyncDeployment:
        """`launch` for scripts: returns a blocking wrapper with the same methods."""
        runner = _LoopThread()
        return SyncDeployment(runner.run(cls.launch(**kwargs)), runner)

    # -- the client API ------------------------------------------------------------------

    def coordinator(self, role: Role) -> Any:
        """The coordinator actor of one instance (rounds, stats, decision log)."""
        return self._coords[role]

    def parent(self, request_id: str) -> ParentKey:
        """The current attempt of `request_id`. Each `handoff` of the same request id
        is a new attempt (both attempt ids advance), so leftovers of an earlier
        attempt (a late cancel, a stale frame) can never touch the new one."""
        attempt = self._attempts.get(request_id, 0)
        return ParentKey(request_id=request_id, ctx_attempt=attempt, gen_attempt=attempt)

    def _new_attempt(self, request_id: str) -> ParentKey:
        if request_id in self._attempts:
            self._attempts[request_id] += 1
        else:
            self._attempts[request_id] = 0
        return self.parent(request_id)

    async def refresh_view(self) -> None:
        """Re-read rank handles and CTX endpoints if any rank restarted since."""
        ctx_epochs, gen_epochs = await asyncio.gather(
            self._coords[Role.CTX].epochs.remote(), self._coords[Role.GEN].epochs.remote()
        )
        epochs = (tuple(ctx_epochs), tuple(gen_epochs))
        if epochs == self._view_epochs:
            return
        # The directory may lag a restart by a moment: wait until it caught up,
        # rather than hand GEN a dead incarnation's endpoint.
        await self._directory.wait_for.remote({Role.CTX.value: ctx_epochs, Role.GEN.value: gen_epochs}, 30.0)
        ctx_handles, gen_handles, entries = await asyncio.gather(
            self._coords[Role.CTX].rank_handles.remote(),
            self._coords[Role.GEN].rank_handles.remote(),
            self._directory.all_of.remote(Role.CTX.value),
        )
        self._view = ({Role.CTX: list(ctx_handles), Role.GEN: list(gen_handles)}, [e[0] for e, _ in entries])
        self._view_epochs = epochs

    async def ranks(self, role: Role) -> list[Any]:
        """The current rank actor handles of one instance (rank i at index i)."""
        await self.refresh_view()
        return self._cached_ranks(role)

    def _cached_ranks(self, role: Role) -> list[Any]:
        assert self._view is not None, "refresh_view() first"
        return list(self._view[0][role])

    async def _all_ranks(self) -> list[Any]:
        return [*(await self.ranks(Role.CTX)), *(await self.ranks(Role.GEN))]

    async def ctx_endpoints(self) -> list[Endpoint]:
        """The current CTX endpoints."""
        await self.refresh_view()
        assert self._view is not None
        return list(self._view[1])

    async def admit(self, request_id: str, num_tokens: int) -> bool:
        """Both admission rounds, concurrently (CTX leases and prefills, GEN leases).

        They are independent: no OPEN is sent before both are admitted, so running
        them side by side takes one round off the critical path. If only one side
        admits, that side's parent is cancelled (nothing was exposed yet)."""
        parent = self.parent(request_id)

        async def one(role: Role) -> bool:
            try:
                return bool(await self._coords[role].admit.remote(parent, num_tokens))
            except AdmissionStopped:  # a rank is restarting: refused, retry later
                return False

        ctx_ok, gen_ok = await asyncio.gather(one(Role.CTX), one(Role.GEN))
        if ctx_ok and gen_ok:
            return True
        losers = [role for role, ok in ((Role.CTX, ctx_ok), (Role.GEN, gen_ok)) if ok]
        await asyncio.gather(*(self._coords[role].cancel.remote(parent) for role in losers))
        return False

    async def send_opens(self, request_id: str, gen_ranks: list[int] | None = None) -> int:
        """Each (or the listed) GEN rank installs the session and sends its OPENs."""
        parent = self.parent(request_id)
        if self._view is None:
            await self.refresh_view()
        assert self._view is not None
        endpoints = self._view[1]
        handles = self._cached_ranks(Role.GEN)
        chosen = range(len(handles)) if gen_ranks is None else gen_ranks
        sent = await asyncio.gather(*(handles[g].send_opens.remote(parent, endpoints) for g in chosen))
        return sum(sent)

    async def wait(self, request_id: str, role: Role, timeout: float) -> list[str]:
        parent = self.parent(request_id)
        handles = self._cached_ranks(role) if self._view is not None else await self.ranks(role)
        found = await asyncio.gather(*(h.wait.remote(parent, timeout) for h in handles), return_exceptions=True)
        # A rank that died mid-request is an outcome (the request failed), not an error.
        return [o if isinstance(o, str) else "died" for o in found]

    async def handoff(
        self, request_id: str, num_tokens: int, *, timeout: float = 60.0, cancel_at: str | None = None
    ) -> HandoffResult:
        """Run one request end to end; returns its outcome (never raises for a
        cancelled or rejected request).

        `cancel_at` injects a cancel at one exact phase (tests, demo, benchmarks):
        - "before_open": both admissions done, no OPEN sent yet;
        - "before_ready": OPENs sent but the OPEN to the last CTX rank is held
          back (so no CTX round can decide the parent), cancel, then deliver it;
        - "mid_dma": cancel once a CTX rank has posted a chunk of this request
          (with a FaultPlan that defers completions, DMA is genuinely in flight);
        - "after_complete": cancel after the GEN side is decode-ready (a no-op:
          the KV stays valid until freed).
        """
        if cancel_at not in CANCEL_PHASES:
            raise ValueError(f"cancel_at must be one of {CANCEL_PHASES}, got {cancel_at!r}")
        start = time.perf_counter()
        self._new_attempt(request_id)
        admitted, _ = await asyncio.gather(self.admit(request_id, num_tokens), self.refresh_view())
        if not admitted:
            # A client cancel that won the admission round is a cancel, not a refusal.
            outcome = "cancelled" if self.parent(request_id) in self._cancelled else "rejected"
            return HandoffResult(request_id=request_id, outcome=outcome, latency_s=time.perf_counter() - start)
        if cancel_at == "before_open":
            await self.cancel(request_id)
        elif cancel_at == "before_ready":
            gen_ranks = await self.ranks(Role.GEN)
            last_ctx = self.ctx_spec.tp - 1
            await asyncio.gather(*(g.hold_frames.remote(Role.CTX.value, last_ctx, True) for g in gen_ranks))
            await self.send_opens(request_id)
            await self.cancel(request_id)
            await asyncio.gather(*(g.hold_frames.remote(Role.CTX.value, last_ctx, False) for g in gen_ranks))
        elif cancel_at == "mid_dma":
            await self.send_opens(request_id)
            await self._until_posted(request_id, timeout)
            await self.cancel(request_id)
        else:
            await self.send_opens(request_id)
        gen = await self.wait(request_id, Role.GEN, timeout)
        latency = time.perf_counter() - start
        verified = 0
        if cancel_at == "after_complete":
            await self.cancel(request_id)
        if all(o == "completed" for o in gen):
            verified = await self._free(request_id)
        ctx = await self.wait(request_id, Role.CTX, timeout)
        outcome = _overall(gen, ctx)
        return HandoffResult(
            request_id=request_id,
            outcome=outcome,
            bytes_verified=verified,
            latency_s=latency,
            ctx_outcomes=tuple(ctx),
            gen_outcomes=tuple(gen),
        )

    async def _until_posted(self, request_id: str, timeout: float) -> None:
        parent = self.parent(request_id)
        ctx_ranks = await self.ranks(Role.CTX)
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            phases = await asyncio.gather(*(h.phase.remote(parent) for h in ctx_ranks))
            if any(p["posted"] > 0 for p in phases) or any(p["state"] in _ENDED for p in phases):
                return
            await asyncio.sleep(0.001)

    async def _free(self, request_id: str) -> int:
        parent = self.parent(request_id)
        handles = self._cached_ranks(Role.GEN)
        sizes = await asyncio.gather(*(h.free.remote(parent) for h in handles), return_exceptions=True)
        return int(sum(n for n in sizes if isinstance(n, int)))

    async def cancel(self, request_id: str) -> None:
        """Cancel a request at any moment: both instances decide it in their next round."""
        parent = self.parent(request_id)
        if len(self._cancelled) > 65536:
            self._cancelled.clear()
        self._cancelled.add(parent)
        await asyncio.gather(*(c.cancel.remote(parent) for c in self._coords.values()), return_exceptions=True)

    async def stats(self) -> dict[str, Any]:
        """Per-rank pool counts and counters, and each coordinator's stats."""
        ranks = await self._all_ranks()
        per_rank = await asyncio.gather(*(h.stats.remote() for h in ranks), return_exceptions=True)
        coords = await asyncio.gather(*(c.stats.remote() for c in self._coords.values()))
        return {
            "name": self.name,
            "qualified": self.qualified,
            "unqualified_reasons": list(self.unqualified_reasons),
            "ranks": [s if isinstance(s, dict) else {"error": repr(s)} for s in per_rank],
            "coordinators": {role.value: c for role, c in zip(self._coords, coords)},
        }

    async def shutdown(self) -> None:
        for coord in self._coords.values():
            with contextlib.suppress(Exception):
                await coord.shutdown.remote()
            ray.kill(coord)
        if self._directory is not None:
            ray.kill(self._directory)


def _overall(gen: list[str], ctx: list[str]) -> str:
    if all(o == "completed" for o in gen):
        return "completed"
    every = set(gen) | set(ctx)
    if {"quarantined", "failed", "died"} & every:
        return "failed"
    if "timeout" in every:
        return "timeout"
    if "rejected" in every and not ({"cancelled", "released"} & every):
        return "rejected"
    return "cancelled"


class _LoopThread:
    """An event loop in a daemon thread, for the synchronous wrapper."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kvhandoff-loop")
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class SyncDeployment:
    """Blocking wrapper around `Deployment` for scripts and Ray jobs."""

    def __init__(self, deployment: Deployment, runner: _LoopThread) -> None:
        self.deployment = deployment
        self._runner = runner

    def handoff(self, request_id: str, num_tokens: int, **kw: Any) -> HandoffResult:
        return self._runner.run(self.deployment.handoff(request_id, num_tokens, **kw))

    def cancel(self, request_id: str) -> None:
        self._runner.run(self.deployment.cancel(request_id))

    def stats(self) -> dict[str, Any]:
        return self._runner.run(self.deployment.stats())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run any coroutine (e.g. a workload) on the deployment's loop."""
        return self._runner.run(coro)

    def shutdown(self) -> None:
        self._runner.run(self.deployment.shutdown())
        self._runner.stop()
