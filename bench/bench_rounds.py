"""Benchmark: agreement-round latency and decisions/s vs ranks and batch size.

Not a test. Starts a local Ray cluster, and for every (ranks, batch) pair
launches a `Coordinator` over minimal rank actors (a `RoundMember` with an
always-yes vote), then fires ``batch`` concurrent ``admit`` calls at a time
and waits for them, repeatedly. Prints one table row per pair:

- round ms (p50 / mean): one round = vote fan-out + apply fan-out, measured
  inside the coordinator;
- admit ms: a client's ``admit`` call end to end (includes queueing and the
  Ray hop from the driver);
- per round: decisions per round actually achieved by batching;
- decisions/s: admissions decided per wall-clock second.

Two client styles: ``admit`` (one Ray call per request, ``batch`` of them in
flight) and ``admit_many`` (one Ray call carrying the whole batch).

The last line is a plain Ray actor round trip, for scale
(docs/design.md "Performance targets").

    python bench/bench_rounds.py [--seconds 1.5] [--ranks 1,2,4,8] [--batches 1,16,128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray

from kvhandoff.actors._coordinator import Coordinator, CoordinatorConfig
from kvhandoff.actors._member import RoundMember, RoundParticipant, VoteNews
from kvhandoff.protocol import ParentKey, RoundDecision, RoundProposal


@ray.remote(num_cpus=0)
class BenchRank(RoundParticipant):
    def __init__(self, rank: int, epoch: int) -> None:
        self.member = RoundMember(rank, epoch, self._vote, self._apply)
        self.applied = 0

    def _vote(self, proposal: RoundProposal) -> VoteNews:
        return VoteNews(admit_ok=tuple(a.parent for a in proposal.admissions))

    def _apply(self, decision: RoundDecision) -> None:
        self.applied += len(decision.admitted)

    async def ping(self) -> None:
        return None


def make_rank(rank: int, epoch: int) -> Any:
    return BenchRank.remote(rank, epoch)


def bench_one(ranks: int, batch: int, seconds: float, many: bool) -> dict[str, float]:
    coordinator = Coordinator.remote(
        f"bench{ranks}", rank_factory=make_rank, tp=ranks, config=CoordinatorConfig(round_timeout=30.0, max_batch=4096)
    )
    serial = 0

    def burst() -> list[float]:
        nonlocal serial
        refs, starts = [], []
        parents = []
        for _ in range(batch):
            serial += 1
            parents.append(ParentKey(request_id=f"p{serial}", ctx_attempt=0, gen_attempt=0))
        if many:  # one call carrying the whole batch
            started = time.perf_counter()
            assert all(ray.get(coordinator.admit_many.remote([(p, 16) for p in parents])))
            return [time.perf_counter() - started] * batch
        for parent in parents:
            starts.append(time.perf_counter())
            refs.append(coordinator.admit.remote(parent, 16))
        latencies = []
        pending = dict(zip(refs, starts, strict=True))
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                assert ray.get(ref) is True
                latencies.append(time.perf_counter() - pending.pop(ref))
        return latencies

    for _ in range(3):  # warm up: actors started, code paths hot
        burst()
    before = ray.get(coordinator.stats.remote())
    latencies: list[float] = []
    started = time.perf_counter()
    decided = 0
    while time.perf_counter() - started < seconds:
        latencies.extend(burst())
        decided += batch
    elapsed = time.perf_counter() - started
    after = ray.get(coordinator.stats.remote())
    rounds = after["rounds"] - before["rounds"]
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)
    return {
        "round_p50_ms": after["round_s_p50"] * 1e3,
        "round_mean_ms": after["round_s_mean"] * 1e3,
        "admit_p50_ms": statistics.median(latencies) * 1e3,
        "per_round": decided / max(rounds, 1),
        "decisions_per_s": decided / elapsed,
        "rounds": rounds,
    }


def ray_round_trip(samples: int = 300) -> float:
    actor = BenchRank.remote(0, 1)
    ray.get(actor.ping.remote())
    started = time.perf_counter()
    for _ in range(samples):
        ray.get(actor.ping.remote())
    ray.kill(actor)
    return (time.perf_counter() - started) / samples * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="measured time per cell")
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--batches", default="1,16,128")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rtt = ray_round_trip()
        header = (
            f"{'ranks':>5} {'batch':>5} {'client':>10} {'round p50 ms':>12} {'round mean ms':>13} "
            f"{'admit p50 ms':>12} {'per round':>9} {'decisions/s':>11}"
        )
        print(header)
        print("-" * len(header))
        for ranks in (int(r) for r in args.ranks.split(",")):
            for batch, many in (
                (int(b), many) for b in args.batches.split(",") for many in (False, True)
            ):
                if many and batch == 1:
                    continue  # same as one admit
                row = bench_one(ranks, batch, args.seconds, many)
                client = "admit_many" if many else "admit"
                print(
                    f"{ranks:>5} {batch:>5} {client:>10} {row['round_p50_ms']:>12.2f} "
                    f"{row['round_mean_ms']:>13.2f} {row['admit_p50_ms']:>12.2f} "
                    f"{row['per_round']:>9.1f} {row['decisions_per_s']:>11.0f}",
                    flush=True,
                )
        print(f"\nplain Ray actor round trip (driver -> actor): {rtt:.2f} ms")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
