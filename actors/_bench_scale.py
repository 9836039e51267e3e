"""`kvhandoff bench --sections scale`: aggregate handoff rate of a fleet.

For each size N in `--scale-sizes` (default 1,2,4) one fleet of N CTX and N
GEN instances (tp=1 each) runs small handoffs for `--sustain-s` seconds from
N x `--scale-clients` clients: the clients grow in proportion to the
instances. Client k sends
its handoffs round-robin over every pair (ctx i, gen j), starting at pair k,
so traffic covers all N x N pairs evenly. The rate is completed handoffs per
second of wall time (the last in-flight ones included).

In the same run, beside them: N_max independent one-pair `Deployment`s at
once (their own directory, coordinators and ranks; the same Ray cluster),
each driven by `--scale-clients` clients: what N_max pairs cost without a
fleet. A fleet must not cost what independent pairs would not.

Ratios (targets): rate(2x2) / rate(1x1) >= 1.8, rate(4x4) / rate(1x1) >=
2.8, rate(4x4 fleet) / rate(4 independent pairs) >= 1.0, on the GPU host
(16 cores); a 2-core box reports them, bound by its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

from kvhandoff.actors._console import Reporter
from kvhandoff.topology import KVLayout

__all__ = ["scale", "scale_targets"]

#: Small requests: one 16 KiB block per rank (the control plane's load, not the link's).
SCALE_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", tokens_per_block=16)


async def _drive(
    handoff: Callable[[int, int], Any], clients: int, seconds: float, failures: collections.Counter[str]
) -> dict[str, Any]:
    """`clients` loops of `handoff(client, i)` for `seconds`; the rate."""
    deadline = time.perf_counter() + seconds
    done = 0
    latencies: list[float] = []

    async def client(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < deadline:
            result = await handoff(k, i)
            i += 1
            if result.outcome == "completed":
                done += 1
                latencies.append(result.latency_s)
            else:
                failures[result.outcome] += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "clients": clients,
        "completed": done,
        "seconds": elapsed,
        "handoffs_per_s": done / elapsed if elapsed > 0 else 0.0,
        "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
    }


async def scale(args: argparse.Namespace, reporter: Reporter, rid: Callable[[str], str]) -> dict[str, Any]:
    """The `scale` section (module docstring)."""
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.actors.fleet import Fleet

    raw = args.scale_sizes
    sizes = sorted({int(s) for s in (raw if isinstance(raw, list) else str(raw).split(",")) if str(s).strip()})
    per = args.scale_clients
    tokens = SCALE_LAYOUT.tokens_per_block  # one block
    pool = max(64, 4 * per * max(sizes))
    failures: collections.Counter[str] = collections.Counter()
    common = dict(
        layout=SCALE_LAYOUT,
        pool_blocks=pool,
        memory=args.memory,
        round_timeout_s=args.round_timeout_s,
        start_timeout_s=args.start_timeout,
        gpus_per_rank=args.gpus_per_rank,
        control_frames=args.control_frames,
        synthetic=False,  # time the protocol, not the test pattern
    )
    rows = []
    for n in sizes:
        with reporter.step(f"launching a {n}x{n} fleet (tp=1)", done=f"{n}x{n} fleet ready"):
            fleet = await Fleet.launch(ctx=n, gen=n, **common)
        try:
            pairs = [(f"ctx{i}", f"gen{j}") for i in range(n) for j in range(n)]
            # Warm every pair once (negotiated at launch; agents load on first use).
            await asyncio.gather(*(fleet.handoff(rid("scale-warm"), tokens, ctx=c, gen=g) for c, g in pairs))

            def one(k: int, i: int, pairs: list[tuple[str, str]] = pairs, fleet: Fleet = fleet) -> Any:
                c, g = pairs[(k + i) % len(pairs)]
                return fleet.handoff(rid("scale"), tokens, ctx=c, gen=g, timeout=30.0)

            with reporter.step(f"{n}x{n}: {per * n} clients for {args.sustain_s:g}s", done=f"{n}x{n} measured"):
                row = await _drive(one, per * n, args.sustain_s, failures)
        finally:
            await fleet.shutdown()
        rows.append({"instances": n, "pairs": len(pairs), **row})
    independent: dict[str, Any] = {}
    k = max(sizes)
    if k > 1:
        with reporter.step(f"launching {k} independent one-pair deployments", done="deployments ready"):
            deps = await asyncio.gather(*(Deployment.launch(ctx_tp=1, gen_tp=1, **common) for _ in range(k)))
        try:
            await asyncio.gather(*(d.handoff(rid("indep-warm"), tokens) for d in deps))

            def indep(c: int, i: int) -> Any:
                return deps[c % k].handoff(rid("indep"), tokens, timeout=30.0)

            with reporter.step(f"{k} independent pairs: {per * k} clients", done="independent pairs measured"):
                independent = {"deployments": k, **await _drive(indep, per * k, args.sustain_s, failures)}
        finally:
            await asyncio.gather(*(d.shutdown() for d in deps), return_exceptions=True)
    base = rows[0]["handoffs_per_s"] if rows and rows[0]["instances"] == 1 else None
    for row in rows:
        row["over_1x1"] = row["handoffs_per_s"] / base if base else None
    out: dict[str, Any] = {"clients_per_instance": per, "seconds": args.sustain_s, "rows": rows}
    if independent:
        out["independent"] = independent
        largest = rows[-1]
        out["largest_over_independent"] = (
            largest["handoffs_per_s"] / independent["handoffs_per_s"] if independent["handoffs_per_s"] else None
        )
    out["failures"] = dict(failures)
    return out


def scale_table(scale_out: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The `scale` section as table rows: one per fleet size, then the independent pairs."""
    headers = ["setup", "clients", "handoffs/s", "x 1x1", "p50 ms"]
    rows: list[list[Any]] = []
    for r in scale_out.get("rows", []):
        p50 = r.get("latency_p50_s")
        rows.append([
            f"fleet {r['instances']}x{r['instances']}", r["clients"], f"{r['handoffs_per_s']:.0f}",
            f"{r['over_1x1']:.2f}" if r.get("over_1x1") else "-", f"{p50 * 1e3:.1f}" if p50 else "-",
        ])
    ind = scale_out.get("independent")
    if ind:
        p50 = ind.get("latency_p50_s")
        rows.append([
            f"{ind['deployments']} independent pairs", ind["clients"], f"{ind['handoffs_per_s']:.0f}",
            "-", f"{p50 * 1e3:.1f}" if p50 else "-",
        ])
    return headers, rows


def scale_targets(scale_out: dict[str, Any], cpu_note: str, add: Callable[..., None]) -> None:
    """The issue's fleet targets from one `scale` result."""
    for row in scale_out.get("rows", []):
        n = row["instances"]
        bound = {2: 1.8, 4: 2.8}.get(n)
        if bound is not None and row.get("over_1x1") is not None:
            add(f"fleet {n}x{n} / 1x1 aggregate handoffs/s", row["over_1x1"], ">=", bound, cpu_note)
    ratio = scale_out.get("largest_over_independent")
    if ratio is not None:
        n = scale_out["rows"][-1]["instances"]
        add(f"fleet {n}x{n} / {n} independent pairs, handoffs/s", ratio, ">=", 1.0, cpu_note)
