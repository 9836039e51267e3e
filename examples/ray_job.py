"""A Ray job that hands off KV caches with the synchronous API.

Run it directly (starts a local Ray cluster):

    python examples/ray_job.py

or run it as a driver of a running cluster, which is what a submitted job is
(checked on a single-node cluster: `ray start` there enables Ray's token
authentication, whose token `RAY_AUTH_MODE=token` picks up from ~/.ray):

    ray start --head --num-cpus=2 --include-dashboard=false --port=6391
    RAY_AUTH_MODE=token RAY_ADDRESS=127.0.0.1:6391 python examples/ray_job.py

`ray job submit --working-dir . -- python examples/ray_job.py` does the same
through the dashboard's job server (it needs `pip install 'ray[default]'`,
which this project does not install).

It launches a CTX instance (tp=2) and a GEN instance (tp=1) on host memory,
hands off a few requests, cancels one of them with a concurrent `cancel()`
from another thread, prints the outcomes and the per-rank block counts, checks that no
block leaked, and shuts down. The exit status is 0 only if nothing leaked and
every request ended.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time

# Workers inherit the driver's environment: set it before Ray starts them.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
if not os.environ.get("RAY_ADDRESS"):
    # A new local cluster: Ray 2.60 turns token authentication on for it and
    # warns on every start unless RAY_AUTH_MODE names the mode. Name it (the
    # same mode, no warning); Ray reads it when imported, hence before that.
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import ray  # noqa: E402

from kvhandoff.actors.deployment import Deployment  # noqa: E402


def main() -> int:
    started = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # `ray job submit`: join the job's cluster
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        started = True

    dep = Deployment.launch_sync(ctx_tp=2, gen_tp=1, pool_blocks=256, memory="DRAM")
    failures: list[str] = []
    try:
        print(f"deployment {dep.deployment.name}: qualified={dep.deployment.qualified}")

        # 1. Plain handoffs: every byte is verified on the GEN side.
        for i, tokens in enumerate((16, 200, 1000)):
            result = dep.handoff(f"job-{i}", tokens, timeout=20.0)
            print(
                f"{result.request_id}: {result.outcome}, {result.bytes_verified} bytes verified, "
                f"{result.latency_s * 1000:.1f} ms"
            )
            if result.outcome != "completed":
                failures.append(f"{result.request_id} ended {result.outcome}")

        # 2. A concurrent cancel: the handoff blocks its thread, the cancel comes
        #    from this one, whatever phase the request is in by then.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(dep.handoff, "job-cancel-race", 1500, timeout=20.0)
            time.sleep(0.01)
            dep.cancel("job-cancel-race")
            result = future.result()
        print(f"{result.request_id}: {result.outcome} (concurrent cancel)")
        if result.outcome not in ("completed", "cancelled", "rejected"):
            failures.append(f"{result.request_id} ended {result.outcome}")

        # 4. Stats: every block is free or quarantined again (L2).
        deadline = time.monotonic() + 20.0
        while True:
            stats = dep.stats()
            ranks = stats["ranks"]
            if all(r.get("leased") == 0 for r in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for r in ranks:
            if "error" in r:
                failures.append(f"rank stats failed: {r['error']}")
                continue
            leaked = r["pool"] - r["free"] - r["quarantined"]
            print(
                f"  {r['role']}{r['rank']}: pool {r['pool']}, free {r['free']}, "
                f"quarantined {r['quarantined']}, leaked {leaked}"
            )
            if leaked:
                failures.append(f"{r['role']}{r['rank']} leaked {leaked} blocks")
            failures.extend(r.get("violations", []))
    finally:
        dep.shutdown()
        if started:
            ray.shutdown()

    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print("ok" if not failures else f"{len(failures)} failures")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
