"""The baseline for examples/vllm_disagg.py: vLLM's own NixlConnector.

The same workload as the example (prefill -> decode of random prompts on the
tiny Llama, with aborts at random stages), with the KV moved by vLLM's
NixlConnector (pull mode: the decode engine READs the prefill engine's blocks
over NIXL/UCX) instead of kvhandoff. Each engine runs in its own Ray actor,
so each has its own NIXL agent, as in a real deployment. The requests follow
vLLM's disaggregated proxy examples: the prefill request carries
``kv_transfer_params={"do_remote_decode": True, ...}`` and ``max_tokens=1``;
the decode request gets the prefill output's ``kv_transfer_params``.

What NixlConnector does on each abort stage (``abort_plan``):

* ``"prefill"``: a vLLM abort on the prefill engine; the blocks are freed at once.
* ``"between"``: the decode request is never sent. The prefill engine holds
  the prompt's blocks until their lease runs out (``kv_lease_duration`` in
  ``kv_connector_extra_config``, 30 s by default; vLLM 0.32 replaced
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` with this lease, which the decode
  engine extends by heartbeats while it loads). Nothing can cancel it sooner.
* ``"load"`` / ``"decode"``: a vLLM abort on the decode engine soon after the
  request is sent, or later. A request aborted while its blocks are being
  read keeps them until the read is over; one aborted before it was
  scheduled tells the prefill engine to free its blocks.

The handoff time is measured on the decode engine by `TimedNixlConnector`
(loaded by vLLM through ``kv_connector_module_path`` = this module): from the
scheduler's ``update_state_after_alloc`` of a request with a remote load to
the step whose ``get_transfer_results`` reports it in ``finished_recving``.
The connector also records each request's external tokens (the prompt
tokens it loads instead of computing): with NixlConnector the decode
output's ``num_cached_tokens`` is not that count, vLLM 0.32 overwrites it with
the prefill engine's own prefix-cache hits (``remote_prefill_cached_tokens``).

NixlConnector connects to a prefill engine lazily, on the first request that
loads from it; one warm-up request does that before anything is measured,
as kvhandoff connects its endpoints before serving.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

__all__ = ["TimedNixlConnector", "run_baseline"]

#: How vLLM (inside an engine actor) imports this module: by its file name,
#: with this directory on the actor's PYTHONPATH.
_MODULE = Path(__file__).stem
_HERE = str(Path(__file__).resolve().parent)

#: This process's loads (one vLLM engine per actor process; the scheduler's
#: and the worker's connector both live in it, the engine running in-process).
_load_started: dict[str, float] = {}  # request id -> perf_counter at update_state_after_alloc
_handoff_s: list[float] = []  # completed loads, in seconds
_first_started: dict[str, float] = {}  # the caller's request id -> perf_counter at update_state_after_alloc
_first_token_s: list[float] = []  # from the allocation to the request's first output token
_external_tokens: dict[str, int] = {}  # the caller's request id -> tokens loaded from outside


class TimedNixlConnector(NixlConnector):
    """vLLM's NixlConnector, timing each load on the decode engine."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # On a CPU platform NixlConnector's worker pins the calling thread -
        # the engine's own, which runs the forward pass - to the last core of
        # each NUMA node ("reserve ... cores for start_load_kv()"): on this
        # 2-core box both engines would share core 1. Undo it, so that the
        # engines run where kvhandoff's do (unpinned); the transfer itself
        # runs in NIXL's own threads.
        affinity = os.sched_getaffinity(0)
        super().__init__(vllm_config, role, kv_cache_config)
        os.sched_setaffinity(0, affinity)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            _load_started[request.request_id] = time.perf_counter()
            # vLLM's request id is the caller's plus a random suffix.
            _external_tokens[get_base_request_id(request.request_id)] = num_external_tokens
            _first_started[get_base_request_id(request.request_id)] = _load_started[request.request_id]
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        now = time.perf_counter()
        for request_id in results.finished_recving or ():
            started = _load_started.pop(request_id, None)
            if started is not None and request_id not in (results.failed_recving or ()):
                _handoff_s.append(now - started)
        return results


#: An engine's start (the model and NIXL), bounded: vLLM's NixlConnector
#: waits without a bound for its side-channel listener, whose thread dies
#: if its port was taken meanwhile (`_free_port` only finds a free one).
#: Seen once in about twenty runs; a new pair of engines gets new ports.
START_S = 300.0
START_ATTEMPTS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The prefill request's ``kv_transfer_params``, as vLLM's proxy examples send them.
_PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


#: The engine's own options, beside the example's ``ENGINE_ARGS`` (which
#: override them): those kvhandoff's `VllmEngine` runs with, so that the two
#: connectors are compared on the same engine.
_ENGINE_OPTIONS = {
    "skip_tokenizer_init": True, "enable_prefix_caching": False, "enforce_eager": True,
    "distributed_executor_backend": "uni",
}


@ray.remote(num_cpus=0)
class NixlEngine:
    """One vLLM engine with `TimedNixlConnector`, in its own process (the
    engine in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, like kvhandoff's
    `VllmEngine`). ``role`` is "prefill" (kv_producer) or "decode" (kv_consumer)."""

    def __init__(self, role: str, model: str, engine_args: dict[str, Any], kv_lease_s: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Each engine serves its NIXL handshake on its own side-channel port
        # (vLLM's default, 5600, for both would clash on one host).
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
        # As in kvhandoff's VllmEngine (the same interval): the handshake
        # listener and handshake threads share the GIL with the engine's steps.
        from kvhandoff.integrations.vllm_connector import SWITCH_INTERVAL_S

        sys.setswitchinterval(SWITCH_INTERVAL_S)
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self._role = role
        transfer = KVTransferConfig(
            kv_connector=TimedNixlConnector.__name__,
            kv_connector_module_path=_MODULE,
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_load_failure_policy="fail",
            kv_connector_extra_config={"kv_lease_duration": kv_lease_s},
        )
        self.llm = LLM(model=model, kv_transfer_config=transfer, **(_ENGINE_OPTIONS | engine_args))
        self._engine = self.llm.llm_engine
        self._connector_state = importlib.import_module(_MODULE)  # the module vLLM loaded the connector from
        self._futures: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._stepper: asyncio.Task[None] | None = None

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run one request to its end: ``{"token_ids", "finish_reason",
        "kv_transfer_params", "external_tokens", "outcome"}``. The prefill
        engine sends the proxy's ``_PREFILL_PARAMS``; the decode engine
        ``kv_transfer_params``, the prefill output's."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if request_id in self._futures:
            raise ValueError(f"request {request_id!r} is already running")
        params = dict(_PREFILL_PARAMS if self._role == "prefill" else kv_transfer_params or {})
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
            extra_args={"kv_transfer_params": params},
        )
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._futures[request_id] = future
        self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_token_ids)), sampling)
        self._ensure_stepping()
        return await future

    async def abort(self, request_id: str) -> bool:
        """A vLLM abort; returns whether the request was still running."""
        future = self._futures.pop(request_id, None)
        self._engine.abort_request([request_id])
        self._connector_state._external_tokens.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result({"token_ids": [], "finish_reason": "abort", "kv_transfer_params": None, "outcome": "aborted"})
        self._ensure_stepping()
        return future is not None

    async def ready(self) -> bool:
        """Answers once the engine is up (a call waits for the constructor)."""
        return True

    async def free_blocks(self) -> int:
        """Free blocks in vLLM's block pool."""
        return int(self._scheduler().kv_cache_manager.block_pool.get_num_free_blocks())

    async def idle(self) -> bool:
        """Whether no request runs and the scheduler holds no finished
        request's blocks for the connector (a send or a load not over)."""
        return not self._futures and not self._engine.has_unfinished_requests() and not self._scheduler().has_requests()

    async def handoff_ms(self, reset: bool = False) -> list[float]:
        """The completed loads' handoff times (decode engine); ``reset`` clears them."""
        out = [s * 1e3 for s in self._connector_state._handoff_s]
        if reset:
            self._connector_state._handoff_s.clear()
            self._connector_state._first_token_s.clear()
        return out

    async def first_token_ms(self) -> list[float]:
        """Per request that loaded its KV (decode engine), from the
        allocation of its blocks to its first output token (ms)."""
        return [s * 1e3 for s in self._connector_state._first_token_s]

    def _scheduler(self) -> Any:
        core = self._engine.engine_core
        return getattr(core, "engine_core", core).scheduler

    def _ensure_stepping(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        # Step while anything is in flight, finished requests whose blocks
        # wait for a transfer included: NixlConnector learns of transfers,
        # notifications and expired leases only in an engine step, as in
        # vLLM's own engine loop (``scheduler.has_requests()``).
        while self._futures or self._engine.has_unfinished_requests() or self._scheduler().has_requests():
            outputs = self._engine.step()
            state = self._connector_state
            if state._first_started:
                now = time.perf_counter()
                for out in outputs:
                    started = state._first_started.pop(out.request_id, None)
                    first = out.outputs[0] if out.outputs else None
                    if started is not None and first is not None and first.token_ids and first.finish_reason in (None, "length", "stop"):
                        state._first_token_s.append(now - started)
            for out in outputs:
                if not out.finished:
                    continue
                external = self._connector_state._external_tokens.pop(out.request_id, 0)
                future = self._futures.pop(out.request_id, None)
                if future is None or future.done():
                    continue
                completion = out.outputs[0]
                reason = str(completion.finish_reason)
                future.set_result({
                    "token_ids": list(completion.token_ids),
                    "finish_reason": reason,
                    "kv_transfer_params": out.kv_transfer_params,
                    "external_tokens": external,
                    "outcome": "completed" if reason in ("length", "stop") else reason,
                })
            # A step that produced nothing (requests wait for a transfer)
            # must not spin: hand the core and the GIL to the rest.
            await asyncio.sleep(0 if outputs else 0.002)


async def run_baseline(
    model_dir: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    abort_plan: list[str | None],
    *,
    max_tokens: int,
    concurrency: int,
    request_timeout_s: float,
    seed: int,
    kv_lease_s: int = 30,
    settle_s: float = 120.0,
) -> dict[str, Any]:
    """Run the prompts prefill -> decode through NixlConnector, aborting
    prompt ``k`` at ``abort_plan[k]`` (None, "prefill", "between", "load" or
    "decode"), and check the decode tokens against ``reference``. Ray must be
    initialized. Returns the counts (as examples/vllm_disagg.py reports
    them), or ``{"error": ...}`` when the engines cannot start."""
    from vllm_disagg import ENGINE_ARGS, ENGINE_ENV  # the example's engines, same settings

    started = time.perf_counter()
    rng = random.Random(seed)
    path = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH")) if p)
    env = {"runtime_env": {"env_vars": {**ENGINE_ENV, "PYTHONPATH": path}}}
    for attempt in range(START_ATTEMPTS):
        prefill = NixlEngine.options(**env).remote("prefill", model_dir, ENGINE_ARGS, kv_lease_s)
        decode = NixlEngine.options(**env).remote("decode", model_dir, ENGINE_ARGS, kv_lease_s)
        engines = {"prefill": prefill, "decode": decode}
        try:
            await asyncio.wait_for(asyncio.gather(prefill.ready.remote(), decode.ready.remote()), START_S)
            break
        except (TimeoutError, ray.exceptions.RayActorError) as exc:
            for engine in engines.values():
                ray.kill(engine)
            if attempt + 1 == START_ATTEMPTS:
                return {"error": f"the NixlConnector engines did not start ({START_ATTEMPTS} tries): {exc!r}"[:2000]}
    try:
        return await _run(engines, prompts, reference, abort_plan, rng, max_tokens, concurrency, request_timeout_s, settle_s, started)
    except ray.exceptions.RayActorError as exc:
        return {"error": f"a NixlConnector engine failed: {exc}"[:2000]}
    finally:
        for engine in engines.values():
            ray.kill(engine)


async def _run(
    engines: dict[str, Any],
    prompts: list[list[int]],
    reference: list[list[int]],
    abort_plan: list[str | None],
    rng: random.Random,
    max_tokens: int,
    concurrency: int,
    request_timeout_s: float,
    settle_s: float,
    started: float,
) -> dict[str, Any]:
    prefill, decode = engines["prefill"], engines["decode"]

    async def wait(ref: Any) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), request_timeout_s)
        except TimeoutError:
            return None

    async def settle() -> float:
        # Until both engines are idle (progress, not a guess), within settle_s.
        t0 = time.monotonic()
        while time.monotonic() < t0 + settle_s and not all(await asyncio.gather(*(e.idle.remote() for e in engines.values()))):
            await asyncio.sleep(0.1)
        return time.monotonic() - t0

    # Warm-up: the first load connects the decode engine's NIXL agent to the
    # prefill engine's (the side-channel handshake). Not measured.
    warm = await wait(prefill.generate.remote("warmup", prompts[0], 1))
    warm_d = await wait(decode.generate.remote("warmup", prompts[0], max_tokens, (warm or {}).get("kv_transfer_params")))
    if not warm_d or warm_d["outcome"] != "completed":
        return {"error": f"warm-up handoff did not complete: prefill {warm}, decode {warm_d}"[:2000]}
    await settle()
    await decode.handoff_ms.remote(reset=True)
    free_at_start = dict(zip(engines, await asyncio.gather(*(e.free_blocks.remote() for e in engines.values()))))

    sem = asyncio.Semaphore(concurrency)
    requests_started = time.perf_counter()

    async def one(k: int) -> dict[str, Any]:
        rid, stage = f"req{k}", abort_plan[k]
        row: dict[str, Any] = {"id": rid, "abort_at": stage}
        async with sem:
            first = prefill.generate.remote(rid, prompts[k], 1)
            if stage == "prefill":
                await asyncio.sleep(rng.random() * 0.02)
                await prefill.abort.remote(rid)
            p = await wait(first)
            if p is None:
                return row | {"outcome": "hung in prefill"}
            params = p.get("kv_transfer_params")
            # Aborted by the client: over, even if the prefill finished first
            # (NixlConnector then holds its blocks until the lease runs out).
            if stage == "prefill" or p["outcome"] != "completed" or not params:
                return row | {"outcome": "aborted" if stage == "prefill" else f"prefill {p['outcome']}"}
            if stage == "between":
                # Nothing to cancel with: the prefill engine's lease frees the blocks.
                return row | {"outcome": "aborted"}
            second = decode.generate.remote(rid, prompts[k], max_tokens, params)
            if stage in ("load", "decode"):
                await asyncio.sleep(rng.random() * (0.01 if stage == "load" else 0.05))
                await decode.abort.remote(rid)
            d = await wait(second)
            if d is None:
                return row | {"outcome": "hung in decode"}
            if d["outcome"] in ("aborted", "completed"):
                row["outcome"] = d["outcome"]
            else:
                row |= {"outcome": "failed", "error": d["outcome"]}
            if d["outcome"] == "completed":
                row |= {"token_exact": d["token_ids"] == reference[k], "external_tokens": d["external_tokens"]}
            return row

    results = list(await asyncio.gather(*(one(k) for k in range(len(prompts)))))
    requests_s = time.perf_counter() - requests_started

    settled_s = await settle()  # a "between" abort's blocks wait out the lease
    free_at_end = dict(zip(engines, await asyncio.gather(*(e.free_blocks.remote() for e in engines.values()))))
    handoff_ms = await decode.handoff_ms.remote()
    first_ms = await decode.first_token_ms.remote()

    completed = [r for r in results if r["outcome"] == "completed"]
    failures = [r for r in results if r["outcome"] not in ("completed", "aborted")]
    return {
        "prompts": len(prompts),
        "completed": len(completed),
        "aborted": sum(r["outcome"] == "aborted" for r in results),
        "failed": len(failures),
        "token_exact": sum(bool(r.get("token_exact")) for r in completed),
        "external_tokens_min": min((r["external_tokens"] for r in completed), default=0),
        "leaked_blocks": {n: free_at_start[n] - free_at_end[n] for n in engines},
        "handoffs": len(handoff_ms),
        "handoff_ms_p50": statistics.median(handoff_ms) if handoff_ms else None,
        "first_token_ms_p50": statistics.median(first_ms) if first_ms else None,
        "requests_s": round(requests_s, 1),
        "settle_s": round(settled_s, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "failures": failures[:10],
    }
