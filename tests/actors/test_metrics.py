"""Metrics through Ray (actors/_metrics.py, docs/metrics.md).

The end-to-end test starts its own local Ray with a metrics export port (the
per-node metrics agent is part of Ray's dashboard agent: it needs
``ray[default]``, which the ``test`` extra installs), runs handoffs and a
cancel through `Deployment.launch`, scrapes Ray's Prometheus endpoint and
reads back exactly what happened: handoffs by outcome, latency counts, bytes
moved and verified, cancels by phase, rounds, and each rank's block gauges
(free + leased + quarantined == pool). It waits on the endpoint showing the
values, never on a guessed duration.

The other tests need no cluster: the metric table's naming rules, that every
name is documented, that a rank exports only counter growth, and that a
failing metric never raises into the caller.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import pathlib
import re
import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvhandoff.actors import _metrics
from kvhandoff.actors._metrics import METRICS, InstanceMetrics, RankMetrics, record_handoff
from kvhandoff.actors.deployment import DEFAULT_LAYOUT
from kvhandoff.topology import blocks_for_tokens

from .helpers import gen_bytes, settled_stats

ray = pytest.importorskip("ray")

POOL = 24
TOKENS = 100  # 7 blocks of 16 tokens
COMPLETED = 4  # three, then one held mid-flight (its OPENs to the last CTX rank held)
TIMEOUT = 60.0
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# -- without a cluster -----------------------------------------------------------------


def test_names_units_and_tags_follow_prometheus_rules() -> None:
    allowed = {"deployment", "instance", "role", "rank", "outcome", "phase", "reason"}
    for name, spec in METRICS.items():
        assert name.startswith("kvhandoff_"), name
        assert set(spec.tags) <= allowed, (name, spec.tags)  # low cardinality: never a request id
        assert (spec.kind == "counter") == name.endswith("_total"), name
        if spec.unit in ("seconds", "bytes"):
            assert f"_{spec.unit}" in name, name
        assert (spec.kind == "histogram") == bool(spec.buckets), name


def test_every_metric_is_documented() -> None:
    text = DOCS.read_text()
    for name, spec in METRICS.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} is not in docs/metrics.md"
        assert spec.kind in row, (name, row)
        for tag in spec.tags:
            assert tag in row, (name, tag, row)


class _Recorder:
    """Stands in for the process's Ray metrics (`_metrics._sink`)."""

    def __init__(self) -> None:
        self.incs: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.observed: list[tuple[str, float]] = []

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        if value > 0:
            self.incs[(name, tuple(sorted(tags.items())))] += value

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.gauges[(name, tuple(sorted(tags.items())))] = value

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self.observed.append((name, value))


def test_a_rank_exports_counter_growth_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = _Recorder()
    monkeypatch.setattr(_metrics, "_sink", sink)
    m = RankMetrics("d", "d-gen", "gen", 0, interval_s=1.0)
    assert m.due(0.0)
    pool = {"free": 20, "leased": 3, "quarantined": 1, "pool": 24, "admission_stopped": False}
    m.cancelled("installed")
    m.export(10.0, **pool, counters={"bytes_verified": 100, "refused_StaleError": 2, "released": 5})
    assert not m.due(10.5) and m.due(11.0)
    m.export(11.0, **pool, counters={"bytes_verified": 160, "refused_StaleError": 2, "released": 6})
    tags = (("deployment", "d"), ("instance", "d-gen"), ("rank", "0"), ("role", "gen"))
    assert sink.incs[("kvhandoff_verified_bytes_total", tags)] == 160
    assert sink.incs[("kvhandoff_frames_refused_total", tuple(sorted((*tags, ("reason", "StaleError")))))] == 2
    assert sink.incs[("kvhandoff_cancels_total", tuple(sorted((*tags, ("phase", "installed")))))] == 1
    assert sink.gauges[("kvhandoff_blocks_quarantined", tags)] == 1
    assert not any(name == "released" for (name, _) in sink.incs)  # only the table's counters


def test_instance_admission_counts_each_stop() -> None:
    sink = _Recorder()
    old, _metrics._sink = _metrics._sink, sink
    try:
        m = InstanceMetrics("d", "d-ctx", "ctx")
        for stopped in (False, False, True, True, False, True):
            m.admission(stopped)
    finally:
        _metrics._sink = old
    tags = (("deployment", "d"), ("instance", "d-ctx"), ("role", "ctx"))
    assert sink.incs[("kvhandoff_admission_stops_total", tags)] == 2
    assert sink.gauges[("kvhandoff_admission_stopped", tags)] == 1


def test_a_failing_metric_never_raises(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def inc(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("metrics agent gone")

        observe = inc

    from ray.util import metrics as ray_metrics

    monkeypatch.setattr(ray_metrics, "Counter", Broken)
    monkeypatch.setattr(ray_metrics, "Histogram", Broken)
    monkeypatch.setattr(_metrics, "_sink", _metrics._Sink())
    with caplog.at_level(logging.WARNING, logger="kvhandoff.metrics"):
        for _ in range(3):
            record_handoff("d", "completed", 0.01)
    assert len([r for r in caplog.records if "metrics" in r.getMessage()]) == 1  # logged once


# -- through Ray's Prometheus endpoint ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_port() -> Iterator[int]:
    """This module's own local Ray with a metrics export port. A Ray left
    running in this process (another module's cluster) is shut down first:
    the export port is fixed when a cluster starts."""
    from ray._private.utils import get_dashboard_dependency_error

    missing = get_dashboard_dependency_error()
    if missing is not None:
        pytest.skip(f"Ray's metrics agent needs ray[default] (pip install -e '.[metrics]'): {missing}")
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    # A new local cluster even where a `ray start` one runs on this machine
    # (a bare init would join it); reports every 0.5 s instead of 10 s.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    try:
        yield port
    finally:
        ray.shutdown()


def _scrape(port: int, deployment: str) -> list[tuple[str, dict[str, str], float]]:
    """The endpoint's kvhandoff samples of `deployment`: (name, labels, value)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
    except OSError:
        return []  # the agent is still starting
    samples = []
    for line in body.splitlines():
        match = _LINE.match(line)
        if match is None or not match["name"].startswith("ray_kvhandoff_"):
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if labels.get("deployment") == deployment:
            samples.append((match["name"][len("ray_"):], labels, float(match["value"])))
    return samples


def _total(samples: list[tuple[str, dict[str, str], float]], name: str, **where: str) -> float:
    return sum(v for n, labels, v in samples if n == name and all(labels.get(k) == w for k, w in where.items()))


def _scrape_until(port: int, deployment: str, ready: Callable[[Any], bool], timeout: float = 60.0) -> Any:
    """Scrape until `ready(samples)` holds (bounded); the last samples either way."""
    deadline = time.monotonic() + timeout
    while True:
        samples = _scrape(port, deployment)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@pytest.mark.ray
def test_prometheus_endpoint_reads_back_handoffs_bytes_and_pools(metrics_port: int) -> None:
    from kvhandoff.actors.deployment import Deployment
    from kvhandoff.cli.harness import handoff_cancel_at, hold_frames, release_frames
    from kvhandoff.protocol import Role

    def holding(ranks: list[tuple[str, str]], blocks: int) -> Callable[[Any], bool]:
        def check(samples: Any) -> bool:
            return all(_total(samples, "kvhandoff_blocks_leased", role=r, rank=k) == blocks for r, k in ranks)

        return check

    def ready(ranks: list[tuple[str, str]], kv: int) -> Callable[[Any], bool]:
        def check(samples: Any) -> bool:
            return (
                _total(samples, "kvhandoff_handoffs_total", outcome="completed") == COMPLETED
                and _total(samples, "kvhandoff_handoffs_total", outcome="cancelled") == 1
                and _total(samples, "kvhandoff_verified_bytes_total") == kv
                and _total(samples, "kvhandoff_moved_bytes_total", role="gen") == kv
                and _total(samples, "kvhandoff_moved_bytes_total", role="ctx") == kv
                and all(_total(samples, "kvhandoff_blocks_free", role=r, rank=k) == POOL for r, k in ranks)
                and _total(samples, "kvhandoff_cancels_total", role="gen") >= 1
                and _total(samples, "kvhandoff_cancels_total", role="ctx") >= 1
            )

        return check

    async def scenario() -> tuple[list[Any], Any, dict[str, Any], Any, Any]:
        dep = await Deployment.launch(
            ctx_tp=2, gen_tp=1, pool_blocks=POOL, chunk_bytes=64 << 10, round_timeout_s=20.0
        )
        # Scraped while the deployment runs, as Prometheus would.
        scrape = functools.partial(asyncio.to_thread, _scrape_until, metrics_port, dep.name)
        ranks = [("ctx", "0"), ("ctx", "1"), ("gen", "0")]
        try:
            done = [await dep.handoff(f"metrics-{i}", TOKENS, timeout=TIMEOUT) for i in range(COMPLETED - 1)]
            # One mid-flight: every rank leased its blocks, no CTX rank can decide
            # it (its OPENs to the last CTX rank wait): the gauges show the leases.
            gens, last = await dep.ranks(Role.GEN), dep.ctx_spec.tp - 1
            await asyncio.gather(*(hold_frames(g, "metrics-held", Role.CTX, last) for g in gens))
            task = asyncio.ensure_future(dep.handoff("metrics-held", TOKENS, timeout=TIMEOUT))
            try:
                in_flight = await scrape(holding(ranks, blocks_for_tokens(dep.layout, TOKENS)))
            finally:
                await asyncio.gather(*(release_frames(g, "metrics-held", Role.CTX, last) for g in gens))
            done.append(await task)
            cancelled = await handoff_cancel_at(dep, "metrics-cancel", TOKENS, "before_open", timeout=TIMEOUT)
            stats = await settled_stats(dep)
            samples = await scrape(ready(ranks, gen_bytes(TOKENS, 1) * COMPLETED))
            return done, cancelled, stats, in_flight, samples
        finally:
            await dep.shutdown()

    done, cancelled, stats, in_flight, samples = asyncio.run(scenario())
    assert [r.outcome for r in done] == ["completed"] * COMPLETED, done
    assert cancelled.outcome == "cancelled", cancelled
    kv = gen_bytes(TOKENS, 1) * COMPLETED  # the KV of every completed handoff (GEN tp=1)
    blocks = blocks_for_tokens(DEFAULT_LAYOUT, TOKENS)
    # Mid-flight, per rank: the blocks of the held handoff leased, the rest free.
    for role, rank in (("ctx", "0"), ("ctx", "1"), ("gen", "0")):
        who = {"role": role, "rank": rank}
        got = [_total(in_flight, f"kvhandoff_blocks_{state}", **who) for state in ("free", "leased", "quarantined")]
        assert got == [POOL - blocks, blocks, 0], (who, got)
        assert sum(got) == _total(in_flight, "kvhandoff_pool_blocks", **who) == POOL
    found = sorted({(n, labels.get("role"), labels.get("rank"), v) for n, labels, v in samples if "le" not in labels})
    # Handoffs by outcome, and one latency observation per handoff.
    assert _total(samples, "kvhandoff_handoffs_total", outcome="completed") == COMPLETED, found
    assert _total(samples, "kvhandoff_handoffs_total", outcome="cancelled") == 1, found
    assert _total(samples, "kvhandoff_handoff_latency_seconds_count", outcome="completed") == COMPLETED
    assert _total(samples, "kvhandoff_handoff_latency_seconds_count", outcome="cancelled") == 1
    # Each latency sits in its bucket (Ray exports the _sum from bucket midpoints: not compared).
    buckets = [(labels["le"], v) for n, labels, v in samples
               if n == "kvhandoff_handoff_latency_seconds_bucket" and labels.get("outcome") == "completed"]
    assert len(buckets) == len(_metrics.LATENCY_BUCKETS_S) + 1, buckets
    for le, count in buckets:
        assert count == sum(r.latency_s <= float(le) for r in done), (le, count, [r.latency_s for r in done])
    # Bytes: the GEN verified and received every completed byte; the CTX ranks wrote them.
    assert _total(samples, "kvhandoff_verified_bytes_total") == kv, found
    assert _total(samples, "kvhandoff_moved_bytes_total", role="gen") == kv, found
    assert _total(samples, "kvhandoff_moved_bytes_total", role="ctx") == kv, found
    # Per rank: the block gauges agree with the pool, and with the rank's stats().
    for s in stats["ranks"]:
        who = {"role": s["role"], "rank": str(s["rank"])}
        free = _total(samples, "kvhandoff_blocks_free", **who)
        leased = _total(samples, "kvhandoff_blocks_leased", **who)
        quarantined = _total(samples, "kvhandoff_blocks_quarantined", **who)
        assert (free, leased, quarantined) == (s["free"], s["leased"], s["quarantined"]) == (POOL, 0, 0), who
        assert free + leased + quarantined == _total(samples, "kvhandoff_pool_blocks", **who) == POOL
        assert _total(samples, "kvhandoff_rank_admission_stopped", **who) == 0
    # The cancel came before any OPEN: the GEN held it admitted, never installed.
    assert _total(samples, "kvhandoff_cancels_total", role="gen", phase="admitted") == 1, found
    # Rounds of both instances: latency and batch size observed, admission never stopped.
    for role in ("ctx", "gen"):
        assert _total(samples, "kvhandoff_round_latency_seconds_count", role=role) >= COMPLETED, found
        assert _total(samples, "kvhandoff_round_batch_size_count", role=role) >= COMPLETED, found
        assert _total(samples, "kvhandoff_admission_stopped", role=role) == 0, found
        assert _total(samples, "kvhandoff_rank_restarts_total", role=role) == 0, found
    # Low cardinality: no request id in any label.
    assert not any("metrics-" in value for _, labels, _ in samples for value in labels.values()), found
