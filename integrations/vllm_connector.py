"""kvhandoff inside vLLM: a KV connector and the Ray actor that hosts an engine.

Theory of operation (docs/vllm.md)
----------------------------------
vLLM keeps its KV tensors, its block manager and its scheduler; kvhandoff
moves a request's KV from a prefill engine to a decode engine between them,
under the cancellation protocol. Three pieces:

* `VllmEngine`, a Ray actor that runs one vLLM engine *in its own process*
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker: the scheduler, the model
  runner and the KV tensors all live here) and hosts the engine's kvhandoff
  rank endpoint (an `EndpointHost`). vLLM stays a library inside a Ray actor,
  the way Ray users run it; the endpoint answers its rounds and frames on its
  own thread while the engine steps.
* `KVHandoffConnector`, the vLLM connector (``kv_connector_module_path`` =
  this module). Worker side: `register_kv_caches` turns vLLM's own paged KV
  tensors into the rank endpoint (registered with NIXL once; the CPU cache is
  the "paged_interleaved" memory kind). Scheduler side, prefill engine:
  `request_finished` of a request sent with ``do_remote_decode`` publishes its
  blocks (one admission round) and returns the ticket in the request's
  ``kv_transfer_params``; vLLM keeps the blocks until the connector reports
  them sent, which is when every CTX rank released them (S1 proven).
  Decode engine: a request whose ``kv_transfer_params`` carry the ticket
  loads its prompt's KV into the blocks vLLM allocated
  (`update_state_after_alloc`), where the endpoint's `receive` drives the
  handoff. A pulled ticket of a pair that has pulled before, small enough
  (``sync_load_max_bytes``), loads *synchronously*: the step that allocated
  the blocks waits in `start_load_kv`, before its forward, for the receive
  to end (at most ``sync_load_wait_s``), and the request decodes in that
  step. Any other ticket loads asynchronously, and the request is reported
  received only once the blocks are back in vLLM's hands. Any outcome but
  "completed" is a failed load (vLLM fails the request under its
  ``kv_load_failure_policy``). A synchronous load that did not end within
  its wait fails its request too, and the connector holds a reference to
  its blocks in vLLM's block pool until the GEN rank gave them back: vLLM
  reuses none of them while a READ may still land (docs/vllm.md).
* Aborts: a vLLM abort of a loading request on the decode engine cancels the
  handoff; vLLM itself keeps the blocks of a request aborted while waiting for
  remote KV until the load is reported finished, which the connector does
  only once the GEN ranks gave the blocks back. A prefill request aborted
  before it finished publishes nothing. A published ticket nobody claims is
  cancelled by the caller (`VllmEngine.cancel`) or ends at its lease deadline.

kvhandoff never frees a vLLM block: it tells vLLM when a block may be reused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

# vLLM is an optional dependency (the `vllm` extra): this module needs it.
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvhandoff.actors.endpoint import (
    EndpointHost,
    EnginePlan,
    ctx_endpoint,
    endpoint_actor,
    endpoint_loop,
    gen_endpoint,
)
from kvhandoff.actors.engine import EngineDeployment, EngineResult
from kvhandoff.actors.engine_fleet import FleetInstance
from kvhandoff.protocol import HandoffTicket, Role, TicketError

__all__ = [
    "KVHandoffConnector", "VllmEngine", "InvalidTransferParams", "TICKET_KEY", "TOKENS_KEY",
    "SYNC_LOAD_MAX_BYTES", "SYNC_LOAD_WAIT_S",
]

#: The keys kvhandoff adds to vLLM's ``kv_transfer_params``.
TICKET_KEY = "kvhandoff_ticket"
TOKENS_KEY = "kvhandoff_tokens"

_MODULE = "kvhandoff.integrations.vllm_connector"

#: The GIL switch interval of an engine's process (Python's default: 5 ms).
#: The endpoint's thread shares the GIL with the engine's steps, and each
#: time it gives the GIL up inside a receive (a NIXL call, a socket write)
#: it waits up to this long to get it back while the engine computes: a
#: pulled receive does so a handful of times. Measured with 8 requests at
#: once (docs/vllm.md): the handoff and the serving time both shorter at
#: 0.1 ms than at 1 ms. The NixlConnector baseline runs with the same.
SWITCH_INTERVAL_S = 0.0001

#: The longest the engine's step waits, where it learns which transfers
#: ended (`get_transfer_results`), for receives its scheduler handed the GEN
#: rank's loop earlier in that step and whose start (`start_receive`: the
#: lease, the READ, its poll, the completion) is still running there. Such
#: a start takes about a millisecond of the rank's thread and the READ's
#: tens of µs; a pulled receive that ends there is then reported in the
#: step it began in, not one step later (docs/vllm.md). Only a start in
#: progress is waited for, never a transfer: a start that does not end
#: within this bound is reported when it does.
START_WAIT_S = 0.002

#: The largest load (bytes on the GEN rank) that loads synchronously
#: (``kv_connector_extra_config["sync_load_max_bytes"]``; 0: never). A
#: synchronous load stalls the decode engine's step, every request in it,
#: until the READ ended: worth it for a load that takes less than the step
#: it saves, not for a long prompt's.
SYNC_LOAD_MAX_BYTES = 8 << 20

#: The longest a step waits in `start_load_kv` for its synchronous loads
#: (``kv_connector_extra_config["sync_load_wait_s"]``). A load not over by
#: then fails its request, and its blocks stay out of vLLM's pool until the
#: receive ended: never a wait without a bound, never a block reused under
#: a READ.
SYNC_LOAD_WAIT_S = 0.05

#: The engine host of this process (one vLLM engine per `VllmEngine` actor).
_HOST: _EngineHost | None = None


class InvalidTransferParams(ValueError):
    """A request's ``kv_transfer_params`` that kvhandoff cannot use (a garbled
    or foreign ticket, a bad token count). The request is refused before the
    engine sees it; nothing changed."""


class _EngineHost:
    """What the connector reaches in its process: the plan, the role, the
    endpoint's deployment handle and the transfers in flight. Every
    kvhandoff call runs on one control loop in its own thread, so the
    engine's thread (a scheduler hook) may wait on one without blocking the
    endpoint, which answers rounds on its own loop."""

    def __init__(self, owner: Any, plan: EnginePlan, role: Role) -> None:
        self.owner = owner
        self.plan = plan
        self.role = role
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvhandoff-control", daemon=True)
        self._thread.start()
        self._dep: EngineDeployment | FleetInstance | None = None
        self._lock = threading.Lock()
        #: Receives handed to the GEN rank's loop whose start has not returned
        #: (`START_WAIT_S`), and the condition their starts' ends notify.
        self._starting = 0
        self._started = threading.Condition(self._lock)
        #: Synchronous loads not waited for yet, or given up and still held
        #: (`wait_loaded`), and the condition their ends notify.
        self._sync: dict[str, _SyncLoad] = {}
        self._ended = threading.Condition(self._lock)
        self._pulls: set[str] = set()  # requests whose ticket is pulled
        #: A pulled receive completed: the GEN rank holds the lender's agent,
        #: so a pulled load takes a READ and no connection's set-up.
        self.connected = False
        self.sync_load_wait_s = SYNC_LOAD_WAIT_S
        self.loads = {"sync": 0, "async": 0, "sync_given_up": 0}
        self.held_blocks = 0  # blocks of given-up loads held in vLLM's pool
        self.sent: set[str] = set()  # prefill: blocks released on every CTX rank
        self.received: set[str] = set()  # decode: load over (either way), blocks back
        self.failed: set[str] = set()  # decode: load over without the KV
        self.outcomes: dict[str, str] = {}  # request id -> handoff outcome (decode)
        self.tickets: dict[str, str] = {}  # request id -> ticket of its transfer in flight
        self.pending = 0  # transfers whose end vLLM has not been told yet
        #: Per completed load: from the decode scheduler's allocation of the
        #: blocks (the load starts) to vLLM being told the KV is there.
        self.handoff_s: list[float] = []
        #: Per publish: how long the engine thread waited in `request_finished`
        #: for the ticket (the prefill side's share of the handoff).
        self.publish_s: list[float] = []
        self._load_started: dict[str, float] = {}
        #: Per request whose KV came from outside: from the allocation to the
        #: engine's first output token of it, in seconds and in steps (1: the
        #: step that allocated the blocks decoded it).
        self.first_token_s: list[float] = []
        self.first_token_steps: list[int] = []
        self._first_started: dict[str, tuple[float, int]] = {}
        self.steps = 0  # engine steps over (the engine's thread)
        self.wake = threading.Event()  # set when vLLM has something to learn (a transfer ended)
        self.kv: list[torch.Tensor] = []  # vLLM's KV tensors, as the endpoint sees them

    # -- the control loop ----------------------------------------------------------

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run `coro` on the control loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def spawn(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def dep(self) -> EngineDeployment | FleetInstance:
        """The deployment (one prefill and one decode instance) or, for an
        instance of an `EngineFleet`, this instance's view of the fleet."""
        if self._dep is None:
            if self.plan.instance:
                self._dep = await FleetInstance.connect(self.plan)
            else:
                self._dep = await EngineDeployment.connect(self.plan)
        return self._dep

    # -- prefill ---------------------------------------------------------------------

    def publish(self, request_id: str, num_tokens: int, blocks: Sequence[int]) -> str:
        async def run() -> str:
            ticket = await (await self.dep()).publish(request_id, num_tokens, blocks)
            return ticket.encode()

        # On the CTX rank's own loop once the deployment handle exists, as a
        # receive runs (`receive`): a pair's publish is the rank's alone.
        loop = endpoint_loop(self.owner) if isinstance(self._dep, EngineDeployment) else None
        started = time.perf_counter()
        text = str(asyncio.run_coroutine_threadsafe(run(), loop or self._loop).result())
        with self._lock:
            self.publish_s.append(time.perf_counter() - started)
            self.tickets[request_id] = text
            self.pending += 1
        self.spawn(self._watch_sent(request_id, text))
        return text

    async def _watch_sent(self, request_id: str, ticket: str) -> None:
        # Held until every CTX rank released the blocks: the transfer
        # completed, or was cancelled and drained, or never started (its
        # lease ended). Quarantined blocks stay held until reclaimed.
        dep = await self.dep()
        while not await dep.returned(ticket, Role.CTX, timeout=60.0):
            pass
        with self._lock:
            self.sent.add(request_id)
            self.tickets.pop(request_id, None)
            self.pending -= 1
        self.wake.set()

    # -- decode ------------------------------------------------------------------------

    def receive(self, request_id: str, ticket: str, blocks: Sequence[int], *, sync: bool = False, pulled: bool = False) -> None:
        with self._lock:
            now = time.perf_counter()
            self._load_started[request_id] = now
            self._first_started[_caller_id(request_id)] = (now, self.steps)  # outputs carry the caller's id
            self.tickets[request_id] = ticket
            self.pending += 1
            self.loads["sync" if sync else "async"] += 1
            if sync:
                self._sync[request_id] = _SyncLoad(list(blocks))
            if pulled:
                self._pulls.add(request_id)
        # A pair's receive goes to the GEN rank, which lives in this process:
        # run it on the rank's own loop once the deployment handle exists
        # (the first call makes it, on the control loop). The receive reaches
        # the rank, and its end reaches the engine thread, with no hop
        # through the control loop: two thread hops fewer, each a wait for
        # the GIL while the engine steps. There `start_receive` runs in the
        # one turn of the loop this call wakes, and a pulled receive whose
        # READ ends at once ends in that turn: every further turn would wait
        # for the GIL again (docs/vllm.md). `EngineDeployment.receive` keeps
        # no state of its own between awaits (Ray calls, tasks it owns), so
        # it runs on either loop.
        loop = endpoint_loop(self.owner) if isinstance(self._dep, EngineDeployment) else None
        if loop is not None:
            with self._lock:
                self._starting += 1
            try:
                loop.call_soon_threadsafe(self._start_receive, request_id, ticket, list(blocks))
            except BaseException:
                self._started_one()
                raise
        else:
            asyncio.run_coroutine_threadsafe(self._receive(request_id, ticket, list(blocks)), self._loop)

    def _start_receive(self, request_id: str, ticket: str, blocks: list[int]) -> None:
        assert isinstance(self._dep, EngineDeployment)
        try:
            try:
                started = self._dep.start_receive(ticket, blocks)
            except Exception as exc:  # a ticket refused before anything was sent
                self._end_receive(request_id, f"refused: {type(exc).__name__}: {exc}")
                return
            if isinstance(started, EngineResult) and started.blocks_returned:
                self._end_receive(request_id, started.outcome)
            else:
                asyncio.ensure_future(self._receive(request_id, ticket, blocks, started))
        finally:
            self._started_one()

    def _started_one(self) -> None:
        with self._lock:
            self._starting -= 1
            self._started.notify_all()

    async def _receive(
        self, request_id: str, ticket: str, blocks: list[int],
        started: EngineResult | asyncio.Future[EngineResult] | None = None,
    ) -> None:
        outcome = "failed"
        try:
            if started is None:
                result = await (await self.dep()).receive(ticket, blocks)
            else:
                result = started if isinstance(started, EngineResult) else await started
            outcome = result.outcome if result.blocks_returned or result.outcome != "completed" else "failed"
            if not result.blocks_returned:
                # Quarantined: vLLM must not get them back before a reclaim.
                dep = await self.dep()
                while not await dep.returned(ticket, Role.GEN, timeout=60.0):
                    pass
        except Exception as exc:  # a ticket refused before anything was sent
            outcome = f"refused: {type(exc).__name__}: {exc}"
        self._end_receive(request_id, outcome)

    def _end_receive(self, request_id: str, outcome: str) -> None:
        """The load of `request_id` is over and its blocks are vLLM's again."""
        with self._lock:
            self.tickets.pop(request_id, None)
            self.pending -= 1
            if request_id in self._pulls:
                self._pulls.discard(request_id)
                self.connected = self.connected or outcome == "completed"
            load = self._sync.get(request_id)
            if load is None:  # asynchronous: vLLM learns of it in `take_finished`
                self.outcomes[request_id] = outcome
                self.received.add(request_id)
                if outcome != "completed":
                    self.failed.add(request_id)
            elif load.held:  # given up by its step: vLLM may have its blocks back now
                del self._sync[request_id]
                self.owner._stepper.submit(lambda: self._release(load.blocks))
            else:  # its step waits for it (`wait_loaded`)
                load.outcome = outcome
                self.outcomes[request_id] = outcome
                self._ended.notify_all()
        self.wake.set()

    def wait_loaded(self, request_ids: Sequence[str]) -> set[int]:
        """In the step that scheduled them, before its forward (the engine's
        thread): wait up to `sync_load_wait_s` for these synchronous loads
        to end. Returns the blocks of those that did not complete (vLLM fails
        their requests). A load still under way is given up: its blocks
        get a reference in vLLM's block pool, dropped once the receive
        ended and the GEN rank gave them back, so vLLM reuses none of them
        while a READ may still write it."""
        invalid: set[int] = set()
        hold: list[int] = []
        with self._lock:
            loads = [(r, self._sync[r]) for r in request_ids if r in self._sync]
            self._ended.wait_for(lambda: all(load.outcome is not None for _, load in loads), self.sync_load_wait_s)
            now = time.perf_counter()
            for request_id, load in loads:
                started = self._load_started.pop(request_id, None)
                if load.outcome is None:
                    load.held = True
                    self.outcomes[request_id] = f"not over within sync_load_wait_s ({self.sync_load_wait_s} s)"
                    self.loads["sync_given_up"] += 1
                    self.held_blocks += len(load.blocks)
                    hold += load.blocks
                    invalid.update(load.blocks)
                    continue
                del self._sync[request_id]
                if load.outcome == "completed":
                    if started is not None:
                        self.handoff_s.append(now - started)
                else:
                    invalid.update(load.blocks)
        if hold:
            pool = self._pool()
            pool.touch([pool.blocks[b] for b in hold])
        return invalid

    def _release(self, blocks: list[int]) -> None:
        """A given-up load's blocks back to vLLM (the engine's thread)."""
        pool = self._pool()
        pool.free_blocks([pool.blocks[b] for b in blocks])
        with self._lock:
            self.held_blocks -= len(blocks)

    def _pool(self) -> Any:
        return self.owner._scheduler().kv_cache_manager.block_pool

    def first_tokens(self, outputs: Sequence[Any]) -> None:
        """After a step (the engine's thread): the first output token of a
        request that took its KV from outside."""
        now = time.perf_counter()
        with self._lock:
            self.steps += 1
            for out in outputs:
                started = self._first_started.pop(out.request_id, None) if self._first_started else None
                if started is None:
                    continue
                first = out.outputs[0] if out.outputs else None
                if first is not None and first.token_ids and first.finish_reason in (None, "length", "stop"):
                    self.first_token_s.append(now - started[0])
                    self.first_token_steps.append(self.steps - started[1])

    def cancel(self, request_id: str) -> None:
        """Cancel the transfer of a request, named by vLLM's internal id or the
        caller's (vLLM adds a random suffix to the caller's id)."""
        with self._lock:
            tickets = [t for rid, t in self.tickets.items() if rid == request_id or _caller_id(rid) == request_id]
        for ticket in tickets:
            self.spawn(self._cancel(ticket))

    def take_outcome(self, request_id: str) -> str | None:
        """The handoff outcome of a decode request (the caller's id), once."""
        with self._lock:
            for rid in list(self.outcomes):
                if rid == request_id or _caller_id(rid) == request_id:
                    return self.outcomes.pop(rid)
        return None

    async def _cancel(self, ticket: str) -> None:
        await (await self.dep()).cancel(ticket)

    def busy(self) -> bool:
        """Transfers in flight, ends vLLM has not been told, or blocks held
        for a given-up load (the engine must step)."""
        with self._lock:
            return bool(self.pending or self.sent or self.received or self.held_blocks)

    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            if self._starting:  # started in this step, and running now: `START_WAIT_S`
                self._started.wait_for(lambda: not self._starting, START_WAIT_S)
            now = time.perf_counter()
            sent, received, failed = self.sent, self.received, self.failed
            self.sent, self.received, self.failed = set(), set(), set()
            for request_id in received:
                started = self._load_started.pop(request_id, None)
                if started is not None and request_id not in failed:
                    self.handoff_s.append(now - started)
        return sent, received, failed


class _SyncLoad:
    """A synchronous load: its GEN blocks, its outcome once the receive
    ended (blocks back), and whether its step gave it up (`wait_loaded`)."""

    __slots__ = ("blocks", "outcome", "held")

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.outcome: str | None = None
        self.held = False


def connector_options(extra: Any) -> tuple[int, float]:
    """``(sync_load_max_bytes, sync_load_wait_s)`` from a
    ``kv_connector_extra_config``; ``ValueError`` for an unknown key or a
    value that is not a number >= 0."""
    extra = dict(extra or {})
    unknown = set(extra) - {"sync_load_max_bytes", "sync_load_wait_s"}
    if unknown:
        raise ValueError(f"kvhandoff connector: unknown options {sorted(unknown)}")
    max_bytes = extra.get("sync_load_max_bytes", SYNC_LOAD_MAX_BYTES)
    wait_s = extra.get("sync_load_wait_s", SYNC_LOAD_WAIT_S)
    for name, value in (("sync_load_max_bytes", max_bytes), ("sync_load_wait_s", wait_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
            raise ValueError(f"kvhandoff connector: {name} must be a finite number >= 0, got {value!r}")
    return int(max_bytes), float(wait_s)


#: vLLM 0.32 runs a request under the caller's id plus a random "-<8 hex>".
_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def _caller_id(request_id: str) -> str:
    return _VLLM_SUFFIX.sub("", request_id)


def check_transfer_params(params: Any, plan: EnginePlan) -> None:
    """`InvalidTransferParams` unless a decode request's kvhandoff params name a
    ticket of this deployment's CTX instance and a positive token count."""
    if not params or TICKET_KEY not in params:
        return
    try:
        ticket = HandoffTicket.decode(params[TICKET_KEY])
    except TicketError as exc:
        raise InvalidTransferParams(f"{TICKET_KEY}: {exc}") from None
    # In a fleet (plan.instance) any CTX instance of it may have published the
    # ticket; the fleet's membership checks it when the load starts.
    foreign = ticket.deployment != plan.name or (not plan.instance and ticket.ctx_instance != plan.ctx.instance_id)
    if foreign:
        raise InvalidTransferParams(f"{TICKET_KEY}: a ticket of {ticket.deployment!r}/{ticket.ctx_instance!r}, not of this deployment")
    tokens = params.get(TOKENS_KEY)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens != ticket.num_tokens:
        raise InvalidTransferParams(f"{TOKENS_KEY} must be the ticket's token count {ticket.num_tokens}, got {tokens!r}")


class _Meta(KVConnectorMetadata):
    """From the scheduler to the worker, per step: the requests whose load
    is synchronous (`KVHandoffConnector.start_load_kv` waits for them).
    Everything else both sides share through the process's host."""

    def __init__(self, sync: list[str]) -> None:
        self.sync = sync


class KVHandoffConnector(KVConnectorBase_V1):
    """The vLLM connector (module docstring). vLLM builds one per role (the
    scheduler's and the worker's) inside a `VllmEngine` actor's process."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if _HOST is None:
            raise RuntimeError("KVHandoffConnector runs inside a kvhandoff VllmEngine actor")
        self._host = _HOST
        self._block_size = int(vllm_config.cache_config.block_size)
        self._sync_max_bytes, wait_s = connector_options(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self._host.sync_load_wait_s = wait_s
        #: request id -> (ticket, tokens, synchronous, pulled), waiting for blocks
        self._loading: dict[str, tuple[str, int, bool, bool]] = {}
        self._sync_step: list[str] = []  # this step's synchronous loads (scheduler side)
        self._invalid: set[int] = set()  # blocks of this step's failed synchronous loads (worker side)

    # -- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        host = self._host
        layout = host.plan.layout
        hl = layout.num_kv_heads // host.plan.spec(host.role).tp
        tensors = []
        for layer in sorted(kv_caches, key=_layer_index):
            t = kv_caches[layer]
            # vLLM's CPU cache: [blocks, kv heads, block size, 2 * head size].
            tensors.append(t.view(t.shape[0], hl, layout.tokens_per_block, 2, layout.head_dim))
        make = ctx_endpoint if host.role is Role.CTX else gen_endpoint
        host.owner.kvhandoff = make(host.plan, 0, tensors)
        host.kv = tensors

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Loads start from the scheduler side (update_state_after_alloc);
        # this step's synchronous ones must be over before its forward.
        meta = self._get_connector_metadata()
        if isinstance(meta, _Meta) and meta.sync:
            self._invalid |= self._host.wait_loaded(meta.sync)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the KV stays where the forward pass wrote it

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._host.take_finished()
        # A failed load is also "received": vLLM then fails the request (or
        # recomputes it) instead of waiting for it.
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received, _ = self._host.take_finished()
        return sent, received

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if TICKET_KEY not in params or params.get("_kvhandoff_taken"):
            return 0, False
        tokens = int(params[TOKENS_KEY])
        count = tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        pulled = self._pulled(params[TICKET_KEY])
        # Synchronous: the full prompt's KV leaves its last token to compute,
        # so the step has one to schedule (vLLM's async path does the same).
        sync_count = min(tokens, request.num_tokens - 1) - num_computed_tokens
        sync = pulled and sync_count > 0 and self._host.connected and self._load_bytes(tokens) <= self._sync_max_bytes
        self._loading[request.request_id] = (params[TICKET_KEY], tokens, sync, pulled)
        return (sync_count, False) if sync else (count, True)

    def _pulled(self, text: str) -> bool:
        try:
            return HandoffTicket.decode(text).lend is not None
        except TicketError:
            return False  # refused when its receive starts

    def _load_bytes(self, tokens: int) -> int:
        layout = self._host.plan.layout
        heads = layout.num_kv_heads // self._host.plan.spec(self._host.role).tp
        return -(-tokens // self._block_size) * layout.num_layers * 2 * heads * layout.head_bytes

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        load = self._loading.pop(request.request_id, None)
        if load is None or num_external_tokens <= 0:
            return
        ticket, tokens, sync, pulled = load
        params = request.kv_transfer_params
        params["_kvhandoff_taken"] = True  # one transfer per request
        need = -(-tokens // self._block_size)
        ids = list(blocks.get_block_ids()[0])[:need]
        self._host.receive(request.request_id, ticket, ids, sync=sync, pulled=pulled)
        if sync:
            self._sync_step.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._sync_step = _Meta(self._sync_step), []
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params or {}
        host = self._host
        if host.role is Role.GEN:
            # Aborted while its KV was on the way: cancel the handoff. vLLM
            # holds the blocks until the load is reported over, which
            # happens once the GEN ranks gave them back.
            self._loading.pop(request.request_id, None)
            if TICKET_KEY in params and not params.get("_kvhandoff_taken"):
                # Aborted before its load started: nobody claimed the ticket,
                # so end it here, or the prefill engine holds its blocks until
                # the ticket's lease runs out.
                host.spawn(host._cancel(params[TICKET_KEY]))
            else:
                host.cancel(request.request_id)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted before its KV was complete: nothing published
        ids = list(block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids)
        tokens = int(request.num_computed_tokens)
        need = -(-tokens // self._block_size)
        if tokens <= 0 or len(ids) < need:
            return False, None
        try:
            ticket = host.publish(request.request_id, tokens, ids[:need])
        except Exception as exc:  # refused: vLLM frees the blocks now, nothing is held
            return False, {"kvhandoff_error": f"{type(exc).__name__}: {exc}"}
        return True, {TICKET_KEY: ticket, TOKENS_KEY: tokens}


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return (digits[0] if digits else 0, name)


class _EngineThread:
    """vLLM's engine, stepped on a thread of its own.

    Never on the actor's event loop: a Ray async actor whose default loop is
    blocked (a step, or a scheduler hook waiting for an admission round)
    stalls *every* concurrency group once a few calls queue up behind it (Ray
    2.60 parks the finished calls' fibers on the blocked loop), so the rank
    endpoint would stop answering its rounds. The actor's methods only post
    commands here; every call into the engine (add, abort, step, the block
    pool) runs on this one thread, between steps, as vLLM requires."""

    def __init__(self, engine: Any, host: _EngineHost, role: Role) -> None:
        self._engine = engine
        self._host = host
        self._role = role
        self._commands: list[tuple[Any, concurrent.futures.Future[Any]]] = []
        self._lock = threading.Lock()
        self.futures: dict[str, concurrent.futures.Future[dict[str, Any]]] = {}
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Any) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on the engine thread before its next step."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._commands.append((fn, done))
        self._host.wake.set()
        return done

    def _run(self) -> None:
        engine, host = self._engine, self._host
        while True:
            with self._lock:
                commands, self._commands = self._commands, []
            for fn, done in commands:
                try:
                    done.set_result(fn())
                except BaseException as exc:  # the caller gets it
                    done.set_exception(exc)
            if not (engine.has_unfinished_requests() or host.busy()):
                host.wake.wait()  # nothing to step: sleep until a command or a transfer's end
                host.wake.clear()
                continue
            outputs = engine.step()
            host.first_tokens(outputs)
            for out in outputs:
                if out.finished:
                    self._finish(out)
            if not outputs:
                # Every request waits for its KV or a transfer's end: wait for
                # one (the host wakes us), polling at most every 2 ms.
                host.wake.wait(0.002)
                host.wake.clear()

    def _finish(self, out: Any) -> None:
        future = self.futures.pop(out.request_id, None)
        if future is None or future.done():
            return
        completion = out.outputs[0]
        reason = str(completion.finish_reason)
        outcome = "completed" if reason in ("length", "stop") else reason
        if self._role is Role.GEN:
            handoff = self._host.take_outcome(out.request_id)
            if handoff is not None and handoff != "completed":
                outcome = f"handoff {handoff}"
        future.set_result({
            "token_ids": list(completion.token_ids),
            "finish_reason": reason,
            "kv_transfer_params": out.kv_transfer_params,
            "num_cached_tokens": out.num_cached_tokens,
            "outcome": outcome,
        })


@endpoint_actor(num_cpus=0)
class VllmEngine(EndpointHost):
    """One vLLM engine in a Ray actor, with kvhandoff's connector and its rank
    endpoint (module docstring). ``role`` is "ctx" (prefill) or "gen"
    (decode); ``engine_args`` go to ``vllm.LLM``. The engine steps on its own
    thread (`_EngineThread`); the actor's methods never block its loop.
    ``connector_config`` is the connector's ``kv_connector_extra_config``:
    ``sync_load_max_bytes`` (`SYNC_LOAD_MAX_BYTES`; 0: every load
    asynchronous) and ``sync_load_wait_s`` (`SYNC_LOAD_WAIT_S`); anything
    else is a ``ValueError``."""

    def __init__(
        self, plan: EnginePlan, role: str, model: str, engine_args: dict[str, Any] | None = None,
        connector_config: dict[str, Any] | None = None,
    ) -> None:
        connector_options(connector_config)  # a bad option fails here, before the engine starts
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self._role = Role(role)
        self._host = _EngineHost(self, plan, self._role)
        # Ray ships this class by value; the connector, which vLLM imports
        # by its module path, finds the host in the imported module.
        importlib.import_module(_MODULE)._HOST = self._host
        self._plan = plan
        transfer = KVTransferConfig(
            kv_connector="KVHandoffConnector",
            kv_connector_module_path=_MODULE,
            kv_role="kv_producer" if self._role is Role.CTX else "kv_consumer",
            kv_load_failure_policy="fail",
            kv_connector_extra_config=dict(connector_config or {}),
        )
        args = {
            "skip_tokenizer_init": True,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "distributed_executor_backend": "uni",
            **(engine_args or {}),
        }
        self.llm = LLM(model=model, kv_transfer_config=transfer, **args)
        self._engine = self.llm.llm_engine
        self._stepper = _EngineThread(self._engine, self._host, self._role)

    # -- serving -------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run one request to its end: ``{"token_ids", "finish_reason",
        "kv_transfer_params", "num_cached_tokens", "outcome"}``. Raises
        `InvalidTransferParams` (nothing submitted) for params kvhandoff
        cannot use, ``ValueError`` for a request id already running."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._role is Role.GEN:
            check_transfer_params(kv_transfer_params, self._plan)
        params = dict(kv_transfer_params or {})
        if self._role is Role.CTX:
            params["do_remote_decode"] = True
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
            extra_args={"kv_transfer_params": params},
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        stepper = self._stepper
        result: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def add() -> None:
            if request_id in stepper.futures:
                raise ValueError(f"request {request_id!r} is already running")
            stepper.futures[request_id] = result
            self._engine.add_request(request_id, prompt, sampling)

        await asyncio.wrap_future(stepper.submit(add))
        return await asyncio.wrap_future(result)

    async def abort(self, request_id: str) -> bool:
        """Abort a request at any moment (a vLLM abort; on the decode engine
        a loading request's handoff is cancelled). Returns whether it was running."""
        stepper = self._stepper

        def abort() -> bool:
            future = stepper.futures.pop(request_id, None)
            self._engine.abort_request([request_id])
            if future is not None and not future.done():
                future.set_result({"token_ids": [], "finish_reason": "abort", "kv_transfer_params": None,
                                   "num_cached_tokens": 0, "outcome": "aborted"})
            # Aborted after it published (the prefill finished first): its
            # ticket must reach no decode engine, so cancel it; the blocks
            # come back once the CTX ranks release them, not at the lease
            # deadline. Here, between steps, a publish is either over (the
            # ticket is known) or can no longer happen.
            self._host.cancel(request_id)
            return future is not None

        return bool(await asyncio.wrap_future(stepper.submit(abort)))

    async def cancel(self, ticket: str) -> None:
        """Cancel a published ticket that no decode engine will claim (the
        prefill engine's blocks come back once the CTX ranks release them)."""
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._host._cancel(ticket), self._host._loop))

    async def free_blocks(self) -> int:
        """Free blocks in vLLM's block pool."""
        pool = lambda: int(self._scheduler().kv_cache_manager.block_pool.get_num_free_blocks())  # noqa: E731
        return int(await asyncio.wrap_future(self._stepper.submit(pool)))

    async def idle(self) -> bool:
        """Whether nothing runs and no transfer is in flight."""

        def quiet() -> bool:
            return not self._engine.has_unfinished_requests() and not self._host.busy() and not self._stepper.futures

        return bool(await asyncio.wrap_future(self._stepper.submit(quiet)))

    async def client_calls(self) -> dict[str, int]:
        """The call counts of this engine's kvhandoff client (its deployment
        handle): how its publishes, receives and cancels went."""
        return dict(getattr(self._host._dep, "calls", None) or {})

    async def publish_ms(self) -> list[float]:
        """Per publish, the prefill engine thread's wait for its ticket (ms)."""
        return [s * 1e3 for s in self._host.publish_s]

    async def handoff_ms(self) -> list[float]:
        """Per completed load (decode engine), from the allocation of its
        blocks to vLLM being told its KV is there: for an asynchronous load
        the step's end that reports it, for a synchronous one the end of
        `start_load_kv`, before the forward that uses it (ms)."""
        return [s * 1e3 for s in self._host.handoff_s]

    async def first_tokens(self) -> dict[str, list[Any]]:
        """Per request that took its KV from outside (decode engine), from
        the allocation of its blocks to its first output token: ``ms``, and
        ``steps`` (1: decoded in the step that allocated them)."""
        host = self._host
        with host._lock:
            return {"ms": [s * 1e3 for s in host.first_token_s], "steps": list(host.first_token_steps)}

    async def loads(self) -> dict[str, int]:
        """How this decode engine's loads went: ``sync`` and ``async`` (by
        kind, since the start), ``sync_given_up`` (not over within
        ``sync_load_wait_s``), ``held_blocks`` (blocks of given-up loads
        still kept out of vLLM's pool), ``in_flight`` (transfers not over)."""
        host = self._host
        with host._lock:
            return {**host.loads, "held_blocks": host.held_blocks, "in_flight": host.pending}

    def _scheduler(self) -> Any:
        core = self._engine.engine_core
        return getattr(core, "engine_core", core).scheduler
