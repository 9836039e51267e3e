"""Metrics through Ray: counters, gauges and histograms on Ray's Prometheus endpoint.

Theory of operation (docs/metrics.md)
-------------------------------------
Every kvhandoff process records through `ray.util.metrics`; Ray's per-node
metrics agent (part of the dashboard agent: it needs ``ray[default]``) serves
them on the node's metrics export port (``ray start --metrics-export-port``,
``ray.init(_metrics_export_port=...)``), prefixed ``ray_`` by Ray. Without
that agent the records are dropped by Ray and nothing here changes.

`METRICS` is the one table of every name, kind, tag keys, unit and help text;
docs/metrics.md documents exactly that table (a test checks it). Names start
with ``kvhandoff_``, carry their unit (``_seconds``, ``_bytes``) and counters
end in ``_total``. Tag keys are low-cardinality only: deployment, instance,
role, rank, outcome, phase, reason. A request id is never a tag.

Who records what, and when (the hot path pays nothing per chunk or frame):

- the client (`Deployment.handoff`, `EngineDeployment.receive`): one counter
  increment and one histogram observation per handoff outcome
  (`record_handoff`);
- a coordinator (`InstanceMetrics`): per round, its latency and batch size;
  per restart and per admission stop, a counter; the admission gauge when
  its state changes;
- a rank actor (`RankMetrics`): nothing on the protocol's paths but a dict
  increment for a cancel; its poll loop's expire tick calls `due()` and, at
  most every `EXPORT_INTERVAL_S`, `export()`, which sets the pool gauges and
  turns the growth of the rank's existing counters (its `stats()` counters,
  the transport's posted bytes, the staging counters) into counter
  increments.

Metrics never raise into the protocol: every call into Ray is guarded; the
first failure in a process is logged (a warning), later ones are ignored.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = [
    "METRICS",
    "EXPORT_INTERVAL_S",
    "LATENCY_BUCKETS_S",
    "BATCH_BUCKETS",
    "MetricSpec",
    "record_handoff",
    "InstanceMetrics",
    "RankMetrics",
    "failed",
    "resident_bytes",
]

log = logging.getLogger("kvhandoff.metrics")

#: Least seconds between two exports of one rank's gauges and counter growth.
EXPORT_INTERVAL_S = 1.0

#: Histogram buckets (upper bounds): handoff and round latencies, seconds.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
#: Histogram buckets (upper bounds): sequential actor hops of a traced handoff.
HOP_BUCKETS = (2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32, 64)
#: Histogram buckets (upper bounds): parents decided per round.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

_CLIENT = ("deployment", "outcome")
_INSTANCE = ("deployment", "instance", "role")
_RANK = ("deployment", "instance", "role", "rank")


class MetricSpec(NamedTuple):
    """One metric: its Ray kind, tag keys, unit and help text (docs/metrics.md)."""

    kind: str  # "counter" | "gauge" | "histogram"
    tags: tuple[str, ...]
    unit: str
    help: str
    buckets: tuple[float, ...] = ()


#: Every metric kvhandoff exports, by name (Ray exports each as ``ray_<name>``).
METRICS: dict[str, MetricSpec] = {
    # -- the client: one handoff, one outcome --------------------------------------------
    "kvhandoff_handoffs_total": MetricSpec(
        "counter", _CLIENT, "handoffs",
        "Handoffs ended, by outcome (completed, cancelled, rejected, failed, timeout).",
    ),
    "kvhandoff_handoff_latency_seconds": MetricSpec(
        "histogram", _CLIENT, "seconds",
        "Seconds from a handoff's submission to its outcome, by outcome.", LATENCY_BUCKETS_S,
    ),
    "kvhandoff_handoff_hops": MetricSpec(
        "histogram", _CLIENT, "hops",
        "Sequential actor hops on a traced handoff's critical path (Deployment.set_trace(export=True)).",
        HOP_BUCKETS,
    ),
    # -- a coordinator: its instance's rounds and recovery --------------------------------
    "kvhandoff_round_latency_seconds": MetricSpec(
        "histogram", _INSTANCE, "seconds",
        "Seconds one agreement round took (vote or reports, decision, apply).", LATENCY_BUCKETS_S,
    ),
    "kvhandoff_round_batch_size": MetricSpec(
        "histogram", _INSTANCE, "parents",
        "Parents one round decided about (admitted, rejected, decided, cancelled, completed, failed).",
        BATCH_BUCKETS,
    ),
    "kvhandoff_round_timeouts_total": MetricSpec(
        "counter", _INSTANCE, "rounds",
        "Rounds a rank missed (watchdog bound, death, stale epoch): each runs the fail policy.",
    ),
    "kvhandoff_rank_restarts_total": MetricSpec(
        "counter", (*_INSTANCE, "reason"), "restarts",
        "Rank actors replaced by a new incarnation; reason: failure (budgeted) or quarantine (asked for).",
    ),
    "kvhandoff_admission_stops_total": MetricSpec(
        "counter", _INSTANCE, "stops",
        "Times the instance stopped admitting (a rank restarting, or the topology failed).",
    ),
    "kvhandoff_admission_stopped": MetricSpec(
        "gauge", _INSTANCE, "boolean",
        "1 while the instance admits nothing (recovering or failed), else 0.",
    ),
    # -- a rank: its pool, its bytes, its refusals ------------------------------------------
    "kvhandoff_blocks_free": MetricSpec("gauge", _RANK, "blocks", "Blocks of the rank's pool that are free."),
    "kvhandoff_blocks_leased": MetricSpec("gauge", _RANK, "blocks", "Blocks leased to a live request."),
    "kvhandoff_blocks_quarantined": MetricSpec(
        "gauge", _RANK, "blocks", "Blocks quarantined (writes not proven quiescent): never reused until proof.",
    ),
    "kvhandoff_pool_blocks": MetricSpec(
        "gauge", _RANK, "blocks", "Blocks in the rank's pool (free + leased + quarantined, S4).",
    ),
    "kvhandoff_rank_admission_stopped": MetricSpec(
        "gauge", _RANK, "boolean", "1 while the rank's quarantine is past its limit (it admits nothing).",
    ),
    "kvhandoff_moved_bytes_total": MetricSpec(
        "counter", _RANK, "bytes",
        "Bytes moved: CTX, of the NIXL WRITEs it posted (direct and staged); GEN, landed in its "
        "blocks for completed handoffs.",
    ),
    "kvhandoff_verified_bytes_total": MetricSpec(
        "counter", _RANK, "bytes", "GEN: bytes checked against the request's pattern (S2; synthetic deployments).",
    ),
    "kvhandoff_quarantines_total": MetricSpec(
        "counter", _RANK, "leases", "Leases quarantined (an edge ended UNKNOWN).",
    ),
    "kvhandoff_reclaimed_blocks_total": MetricSpec(
        "counter", _RANK, "blocks", "Quarantined blocks given back on a proof of quiescence.",
    ),
    "kvhandoff_cancels_total": MetricSpec(
        "counter", (*_RANK, "phase"), "cancels",
        "Cancels applied by the rank, by the parent's local state when the round decided it "
        "(admitted, resident, installed, decided, settled, ...).",
    ),
    "kvhandoff_frames_refused_total": MetricSpec(
        "counter", (*_RANK, "reason"), "frames",
        "Frames (and peer notices, admissions without an agreed protocol) refused without a state "
        "change (S3), by reason: the suffix of the rank's refused_<reason> counter.",
    ),
    "kvhandoff_staged_chunks_total": MetricSpec(
        "counter", _RANK, "chunks", "Staged chunks: CTX, slot WRITEs posted; GEN, slots scattered into its blocks.",
    ),
    "kvhandoff_staging_slots_quarantined_total": MetricSpec(
        "counter", _RANK, "slots", "CTX: staging slots quarantined (their WRITE not proven done in time).",
    ),
}

# A rank's cumulative counters (its `stats()` counters, plus the keys the
# rank adds in `RankCore._export_metrics`) -> the metric their growth feeds.
_RANK_COUNTERS = {
    "moved_bytes": "kvhandoff_moved_bytes_total",
    "bytes_verified": "kvhandoff_verified_bytes_total",
    "quarantined": "kvhandoff_quarantines_total",
    "reclaimed_blocks": "kvhandoff_reclaimed_blocks_total",
    "staged_chunks": "kvhandoff_staged_chunks_total",
    "slots_quarantined": "kvhandoff_staging_slots_quarantined_total",
}
_REFUSED = "refused_"


class _Sink:
    """This process's Ray metric objects, made on first use. Every call is
    guarded: the first failure is logged, the rest ignored (metrics never
    raise into the protocol); a metric that cannot be made is not retried."""

    def __init__(self) -> None:
        self._made: dict[str, Any] = {}
        self._broken: set[str] = set()
        self._warned = False

    def _failed(self, name: str, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("metrics: recording %s failed (ignored from now on): %r", name, exc)

    def _metric(self, name: str) -> Any:
        metric = self._made.get(name)
        if metric is None and name not in self._broken:
            spec = METRICS[name]
            try:
                from ray.util import metrics as ray_metrics

                if spec.kind == "counter":
                    metric = ray_metrics.Counter(name, description=spec.help, tag_keys=spec.tags)
                elif spec.kind == "gauge":
                    metric = ray_metrics.Gauge(name, description=spec.help, tag_keys=spec.tags)
                else:
                    metric = ray_metrics.Histogram(
                        name, description=spec.help, boundaries=list(spec.buckets), tag_keys=spec.tags
                    )
            except Exception as exc:
                self._broken.add(name)
                self._failed(name, exc)
                return None
            self._made[name] = metric
        return metric

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        if value > 0:  # Ray refuses a zero increment; nothing happened anyway
            self._record(name, "inc", value, tags)

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._record(name, "set", value, tags)

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._record(name, "observe", value, tags)

    def _record(self, name: str, how: str, value: float, tags: dict[str, str]) -> None:
        """``metric.<how>(value, tags=tags)``; a failure is counted, never raised."""
        try:
            metric = self._metric(name)
            if metric is not None:
                getattr(metric, how)(value, tags=tags)
        except Exception as exc:
            self._failed(name, exc)


_sink = _Sink()


def resident_bytes() -> int | None:
    """This process's resident memory in bytes (Linux `/proc`), or None where
    it cannot be read. For `stats()`: an operator (and the bench's soak)
    watches a long-running rank or coordinator stay flat."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def failed(what: str, exc: BaseException) -> None:
    """Gathering what a metric records failed: logged once per process, ignored."""
    _sink._failed(what, exc)


def record_handoff(deployment: str, outcome: str, latency_s: float) -> None:
    """The client saw one handoff end with `outcome` after `latency_s` seconds."""
    tags = {"deployment": deployment, "outcome": str(outcome)}
    _sink.inc("kvhandoff_handoffs_total", 1, tags)
    _sink.observe("kvhandoff_handoff_latency_seconds", max(float(latency_s), 0.0), tags)


def record_hops(deployment: str, outcome: str, hops: int) -> None:
    """A traced handoff ended with `outcome` after `hops` sequential hops."""
    _sink.observe("kvhandoff_handoff_hops", float(hops), {"deployment": deployment, "outcome": str(outcome)})


class InstanceMetrics:
    """A coordinator's metrics: its instance's rounds, restarts and admission."""

    def __init__(self, deployment: str, instance: str, role: str) -> None:
        self.tags = {"deployment": deployment, "instance": instance, "role": role}
        self._stopped: bool | None = None

    @classmethod
    def for_actor(cls, instance: str) -> InstanceMetrics:
        """Tags from this actor's name, ``<deployment>.coord.<role>`` (how both
        deployments name their coordinators); empty where it is not one."""
        deployment = role = ""
        try:
            import ray

            if ray.is_initialized():
                name = ray.get_runtime_context().get_actor_name() or ""
                if ".coord." in name:
                    deployment, _, role = name.rpartition(".coord.")
        except Exception as exc:
            failed("coordinator tags", exc)
        return cls(deployment, instance, role)

    def round(self, seconds: float, batch: int) -> None:
        _sink.observe("kvhandoff_round_latency_seconds", seconds, self.tags)
        _sink.observe("kvhandoff_round_batch_size", batch, self.tags)

    def round_timed_out(self) -> None:
        _sink.inc("kvhandoff_round_timeouts_total", 1, self.tags)

    def restarted(self, reason: str) -> None:
        _sink.inc("kvhandoff_rank_restarts_total", 1, {**self.tags, "reason": reason})

    def admission(self, stopped: bool) -> None:
        """The instance's admission state is `stopped` (called on every state change)."""
        if stopped == self._stopped:
            return
        if stopped and self._stopped is not None:
            _sink.inc("kvhandoff_admission_stops_total", 1, self.tags)
        self._stopped = stopped
        _sink.set("kvhandoff_admission_stopped", int(stopped), self.tags)


class RankMetrics:
    """A rank's metrics. Cancels are counted locally; everything reaches Ray
    in `export`, which the poll loop runs when `due` (module docstring)."""

    def __init__(
        self, deployment: str, instance: str, role: str, rank: int, interval_s: float = EXPORT_INTERVAL_S
    ) -> None:
        self.tags = {"deployment": deployment, "instance": instance, "role": role, "rank": str(rank)}
        self.interval_s = interval_s
        self._next = 0.0
        self._exported: dict[str, float] = {}  # counter key -> value already exported
        self.cancels: collections.Counter[str] = collections.Counter()

    def cancelled(self, phase: str) -> None:
        """The rank applied a cancel of a parent in local state `phase`."""
        self.cancels[phase] += 1

    def due(self, now: float) -> bool:
        """Whether an export is due at `now` (monotonic seconds)."""
        return now >= self._next

    def export(
        self,
        now: float,
        *,
        free: int,
        leased: int,
        quarantined: int,
        pool: int,
        admission_stopped: bool,
        counters: Mapping[str, int],
    ) -> None:
        """Set the gauges; increment each counter by what its cumulative value
        in `counters` grew since the last export."""
        self._next = now + self.interval_s
        tags = self.tags
        _sink.set("kvhandoff_blocks_free", free, tags)
        _sink.set("kvhandoff_blocks_leased", leased, tags)
        _sink.set("kvhandoff_blocks_quarantined", quarantined, tags)
        _sink.set("kvhandoff_pool_blocks", pool, tags)
        _sink.set("kvhandoff_rank_admission_stopped", int(admission_stopped), tags)
        for key, value in counters.items():
            name = _RANK_COUNTERS.get(key)
            if name is not None:
                self._grow(key, name, value, tags)
            elif key.startswith(_REFUSED):
                reason = key[len(_REFUSED):]
                self._grow(key, "kvhandoff_frames_refused_total", value, {**tags, "reason": reason})
        for phase, value in self.cancels.items():
            self._grow(f"cancel {phase}", "kvhandoff_cancels_total", value, {**tags, "phase": phase})

    def _grow(self, key: str, name: str, value: float, tags: dict[str, str]) -> None:
        delta = value - self._exported.get(key, 0)
        if delta > 0:
            self._exported[key] = value
            _sink.inc(name, delta, tags)
