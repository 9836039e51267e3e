"""Disaggregated generation with a real model: prefill at TP=2, decode at TP=1.

A small Llama-architecture model (transformers, seeded random weights, no
download) runs in an engine's own Ray actors:

- two **prefill workers** (the CTX instance, TP=2): each runs the prompt
  through the model and keeps *its half of the KV heads* in its own paged KV
  pool (vLLM layout: one tensor per layer, ``[blocks, 2, 16, heads, dim]``),
  in blocks the prefill block manager chose;
- one **decode worker** (the GEN instance, TP=1): it receives every head into
  its own paged pool, in blocks the decode block manager chose, rebuilds the
  model's cache from those blocks and decodes greedily.

Both workers host a kvhandoff endpoint over their tensors (`EndpointHost`).
The driver plays the engine's schedulers and the HTTP front end between
them: it publishes each prefilled request (`EngineDeployment.publish`), carries
the ticket's string form to the decode side, receives into the decode blocks
(`receive`), and reuses a block only once kvhandoff gave it back
(`returned`). A share of the requests is cancelled at random moments (before
the decode side asks, while it asks, while the KV moves); the phase each
cancel met on the CTX ranks is recorded.

Every completed request's tokens must equal the monolithic
``model.generate`` output token for token; a cancelled one produces nothing;
no block is left held anywhere. The last line printed with ``--json`` is one
JSON object (prompts, completed, cancelled, failed, token_exact,
leaked_blocks, wall_s, ...); the exit status is non-zero when a completed
request is not token-exact or anything leaked.

    python examples/disagg_generate.py --json              # CPU, no flags needed
    python examples/disagg_generate.py --device cuda --json  # VRAM pools on GPUs
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_kv, beside this file

import llama_kv  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from kvhandoff.actors.endpoint import EnginePlan, ctx_endpoint, gen_endpoint  # noqa: E402
from kvhandoff.actors.engine import EngineDeployment  # noqa: E402
from kvhandoff.actors.rank import EndpointHost, endpoint_actor  # noqa: E402
from kvhandoff.cli.harness import hold_frames, release_frames  # noqa: E402
from kvhandoff.protocol import HandoffTicket, Role  # noqa: E402
from kvhandoff.topology import KVLayout  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16}
TOKENS_PER_BLOCK = 16


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class _Worker(EndpointHost):
    """An engine worker: the model, its own paged KV pool, a hosted endpoint."""

    def __init__(self, plan: EnginePlan, role: str, rank: int, seed: int, device: str, dtype: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        torch.set_num_threads(1)
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self.role = Role(role)
        self.device = device
        self.model = llama_kv.build_model(seed, device=device, dtype=_dtype(dtype), **MODEL)
        tp = plan.spec(self.role).tp
        self.heads = MODEL["num_kv_heads"] // tp
        self.head_lo = rank * self.heads
        num_blocks = plan_blocks(plan, self.role)
        self.pool = llama_kv.alloc_pool(
            self.model, num_blocks, kv_heads=self.heads, tokens_per_block=TOKENS_PER_BLOCK, device=device
        )
        make = ctx_endpoint if self.role is Role.CTX else gen_endpoint
        self.kvhandoff = make(plan, rank, self.pool)

    # The model runs on a thread of this actor's own (one at a time), never on
    # its event loop: the hosted endpoint has its own loop (the actor's
    # "kvhandoff" concurrency group), but Ray stalls every group of an async
    # actor once a call queues behind a blocked default loop (docs/design.md,
    # "The endpoint has its own event loop").

    async def prefill(self, prompt: list[int], blocks: list[int]) -> int:
        """CTX: run the prompt; keep our KV heads in `blocks`; the first token."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, self._prefill, prompt, blocks)

    def _prefill(self, prompt: list[int], blocks: list[int]) -> int:
        kv, first = llama_kv.prefill(self.model, prompt)
        llama_kv.write_pool(self.pool, blocks, kv, head_lo=self.head_lo, head_hi=self.head_lo + self.heads)
        if self.device == "cuda":
            torch.cuda.synchronize()  # the KV is in memory before anyone may move it
        return int(first)

    async def decode(self, blocks: list[int], prompt_len: int, first: int, max_new: int) -> list[int]:
        """GEN: rebuild the cache from our own blocks and decode greedily."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, self._decode, blocks, prompt_len, first, max_new)

    def _decode(self, blocks: list[int], prompt_len: int, first: int, max_new: int) -> list[int]:
        cache = llama_kv.cache_from_pool(self.model, self.pool, blocks, prompt_len)
        return llama_kv.greedy_decode(self.model, cache, first, prompt_len, max_new)


Worker = endpoint_actor(num_cpus=0)(_Worker)


def plan_blocks(plan: EnginePlan, role: Role) -> int:
    return 96


class BlockManager:
    """One instance's block manager (the engine's): a free list of block ids."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free: collections.deque[int] = collections.deque(range(n))
        self.available = asyncio.Condition()

    async def take(self, k: int) -> list[int]:
        async with self.available:
            await self.available.wait_for(lambda: len(self.free) >= k)
            return [self.free.popleft() for _ in range(k)]

    async def give(self, blocks: list[int]) -> None:
        async with self.available:
            self.free.extend(blocks)
            self.available.notify_all()


async def _phase(ctx: list[Any], ticket: HandoffTicket) -> str:
    """What the CTX ranks were doing when the cancel was sent."""
    phases = await asyncio.gather(*(w.phase.remote(ticket.parent) for w in ctx))
    posted = sum(p.get("posted", 0) for p in phases)
    states = {str(p["state"]) for p in phases}
    if posted and any(p.get("in_flight", 0) for p in phases):
        return "mid_transfer"
    if posted:
        return "dma_posted"
    return "+".join(sorted(states))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    layout = KVLayout(
        num_layers=MODEL["num_layers"],
        num_kv_heads=MODEL["num_kv_heads"],
        head_dim=MODEL["head_dim"],
        dtype=args.dtype,
        tokens_per_block=TOKENS_PER_BLOCK,
    )
    assert layout.dtype_bytes == dtype_bytes
    memory = "VRAM" if args.device == "cuda" else "DRAM"
    dep = await EngineDeployment.create(
        ctx_tp=2, gen_tp=1, layout=layout, ctx_memory="paged", gen_memory="paged",
        memory=memory, chunk_bytes=args.chunk_bytes,
    )
    # Three workers: on two GPUs half a GPU each (Ray packs two on one GPU,
    # the third on the other); on one GPU a third each.
    gpus = ray.cluster_resources().get("GPU", 0)
    gpu = {"num_gpus": 0.5 if gpus >= 2 else 0.33} if args.device == "cuda" else {}
    ctx = [Worker.options(**gpu).remote(dep.plan, "ctx", r, args.seed, args.device, args.dtype) for r in range(2)]
    gen = [Worker.options(**gpu).remote(dep.plan, "gen", 0, args.seed, args.device, args.dtype)]
    await dep.attach(ctx, gen)
    ctx_blocks, gen_blocks = BlockManager(plan_blocks(dep.plan, Role.CTX)), BlockManager(plan_blocks(dep.plan, Role.GEN))

    rng = random.Random(args.seed)
    prompts = llama_kv.random_prompts(args.seed, args.prompts, 3, 70, 256)
    # The monolithic run, here in the driver (same seeded weights): the
    # workers' event loops stay free for the handoffs.
    reference_model = llama_kv.build_model(args.seed, device=args.device, dtype=_dtype(args.dtype), **MODEL)
    references = [llama_kv.reference_generate(reference_model, p, args.max_new_tokens) for p in prompts]
    to_cancel = set(rng.sample(range(len(prompts)), math.ceil(args.cancel_fraction * len(prompts))))
    moments = ["before_receive", "with_receive", "during_receive", "after_post"]
    counts: collections.Counter[str] = collections.Counter()
    cancel_phases: collections.Counter[str] = collections.Counter()
    cancel_moments: collections.Counter[str] = collections.Counter()
    receive_ms: list[float] = []
    mismatches: list[dict[str, Any]] = []
    window = asyncio.Semaphore(args.concurrency)

    async def one(i: int, prompt: list[int]) -> None:
        async with window:
            request_id = f"req-{i}"
            n = -(-len(prompt) // TOKENS_PER_BLOCK)
            ours = await ctx_blocks.take(n)
            firsts = await asyncio.gather(*(w.prefill.remote(prompt, ours) for w in ctx))
            assert len(set(firsts)) == 1, "both prefill ranks ran the same model"
            ticket = await dep.publish(request_id, len(prompt), ours)
            wire = ticket.encode()  # the front end carries this string to the decode server
            moment = rng.choice(moments) if i in to_cancel else None

            async def cancel(delay: float) -> None:
                await asyncio.sleep(delay)
                cancel_phases[await _phase(ctx, ticket)] += 1
                await dep.cancel(wire)

            async def cancel_after_post(ticket: HandoffTicket, wire: str) -> None:
                try:
                    # Wait on progress, not time: until a CTX rank posted a chunk
                    # (or the request ended there), bounded by the receive's bound.
                    async with asyncio.timeout(120):
                        while True:
                            phases = await asyncio.gather(*(w.phase.remote(ticket.parent) for w in ctx))
                            if any(p.get("posted", 0) for p in phases) or any(
                                str(p["state"]) in ("cancelled", "released", "failed", "rejected") for p in phases
                            ):
                                break
                            await asyncio.sleep(0.001)
                    cancel_phases[await _phase(ctx, ticket)] += 1
                    await dep.cancel(wire)
                finally:
                    for w in ctx:
                        await release_frames(w, request_id, Role.GEN, 0)

            if moment == "before_receive":
                await cancel(0.0)
            theirs = await gen_blocks.take(n)
            canceller = None
            if moment in ("with_receive", "during_receive"):
                delay = 0.0 if moment == "with_receive" else rng.uniform(0.0, 0.15)
                canceller = asyncio.ensure_future(cancel(delay))
            elif moment == "after_post":
                # The hardest moment: the CTX ranks posted their WRITEs but the
                # GEN has not heard (their READY/TERMINAL frames are held back
                # by kvhandoff's test harness until the cancel is sent).
                for w in ctx:
                    await hold_frames(w, request_id, Role.GEN, 0)
                canceller = asyncio.ensure_future(cancel_after_post(ticket, wire))
            result = await dep.receive(HandoffTicket.decode(wire), theirs, timeout=120)
            if canceller is not None:
                await canceller
            outcome = result.outcome
            if moment is not None:
                counts["cancel_requested"] += 1
                cancel_moments[moment] += 1
                if outcome == "rejected":
                    outcome = "cancelled"  # cancelled before the decode side claimed it
            counts[outcome] += 1
            if outcome == "completed":
                receive_ms.append(result.latency_s * 1e3)
                tokens = await gen[0].decode.remote(theirs, len(prompt), firsts[0], args.max_new_tokens)
                want = references[i]
                if tokens == want:
                    counts["token_exact"] += 1
                else:
                    mismatches.append({"request": request_id, "got": tokens, "want": want})
            # The engine reuses blocks only once kvhandoff gave them back.
            if result.blocks_returned or await dep.returned(ticket, Role.GEN, timeout=120):
                await gen_blocks.give(theirs)
            else:
                counts["gen_blocks_kept"] += 1
            if await dep.returned(ticket, Role.CTX, timeout=120):
                await ctx_blocks.give(ours)
            else:
                counts["ctx_blocks_kept"] += 1

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    stats = await dep.stats()
    leaked_by_rank = {
        f"{s.get('role')}{s.get('rank')}": s.get("leased", 0) + s.get("quarantined", 0) for s in stats["ranks"]
    }
    held = sum(leaked_by_rank.values())
    engine_missing = (ctx_blocks.n - len(ctx_blocks.free)) + (gen_blocks.n - len(gen_blocks.free))
    violations = [v for s in stats["ranks"] for v in s.get("violations", [])]
    bytes_moved = sum(s.get("posted_bytes", 0) for s in stats["ranks"])
    staging = [s.get("staging", {}) for s in stats["ranks"]]
    staged_chunks = sum(st.get("counters", {}).get("staged_chunks", 0) for st in staging)
    slots_quarantined = sum(st.get("slots", {}).get("quarantined", 0) for st in staging)
    await dep.shutdown()
    for w in ctx + gen:
        ray.kill(w)
    return {
        "prompts": len(prompts),
        "prompt_lengths": [len(p) for p in prompts],  # one per prompt, in order
        "completed": counts["completed"],
        "cancelled": counts["cancelled"],
        "rejected": counts["rejected"],
        "failed": counts["failed"] + counts["timeout"],
        "cancel_requested": counts["cancel_requested"],
        "cancel_moments": dict(cancel_moments),
        "cancel_phases": dict(cancel_phases),
        "token_exact": counts["token_exact"],
        "mismatches": mismatches[:3],
        "leaked_blocks": held + engine_missing,
        "leaked_by_rank": leaked_by_rank,
        "engine_blocks_missing": engine_missing,
        "violations": violations,
        "kv_bytes_moved": bytes_moved,
        # The data plane (docs/design.md): chunks that went gather -> one WRITE -> scatter.
        "staged_chunks": staged_chunks,
        "slots_quarantined": slots_quarantined,
        # `receive` of a completed request: claim, DMA, completion round, blocks back.
        "receive_ms_p50": round(sorted(receive_ms)[len(receive_ms) // 2], 2) if receive_ms else None,
        "receive_ms_max": round(max(receive_ms), 2) if receive_ms else None,
        "device": args.device,
        "dtype": args.dtype,
        "ctx_tp": 2,
        "gen_tp": 1,
        "max_new_tokens": args.max_new_tokens,
        "wall_s": round(time.perf_counter() - started, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--prompts", type=int, default=24, help="requests to run")
    parser.add_argument("--cancel-fraction", type=float, default=0.4, help="share of requests cancelled")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens decoded per request")
    parser.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    parser.add_argument("--chunk-bytes", type=int, default=4096, help="bytes per NIXL WRITE chunk")
    parser.add_argument("--seed", type=int, default=0, help="model weights, prompts and cancel choices")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models and KV pools live")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="model and KV dtype")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if args.prompts < 1 or not 0 <= args.cancel_fraction <= 1 or args.concurrency < 1:
        parser.error("--prompts and --concurrency must be >= 1, --cancel-fraction in [0, 1]")
    # The workers import llama_kv from beside this file (and keep whatever
    # PYTHONPATH the driver has).
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    try:
        report = asyncio.run(run(args))
    finally:
        ray.shutdown()
    ok = report["token_exact"] == report["completed"] and report["leaked_blocks"] == 0 and not report["violations"]
    report["ok"] = ok
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>18}: {value}")
    print(verdict(report), file=sys.stderr if args.json else sys.stdout)
    return 0 if ok else 1


def verdict(report: dict[str, Any]) -> str:
    """The run in one line: were the completed requests token-exact, did
    anything leak, was an invariant broken."""
    exact, done = report["token_exact"], report["completed"]
    if report["ok"]:
        return (
            f"ok: all {done} completed requests decoded token-exact "
            f"({report['cancelled']} cancelled), 0 blocks leaked, no invariant violated"
        )
    wrong = [f"{done - exact} of {done} completed requests not token-exact"] if exact != done else []
    wrong += [f"{report['leaked_blocks']} blocks leaked"] if report["leaked_blocks"] else []
    wrong += [f"{len(report['violations'])} invariant violations"] if report["violations"] else []
    return "NOT ok: " + ", ".join(wrong)


if __name__ == "__main__":
    sys.exit(main())
