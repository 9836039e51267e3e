"""`RecentMemory`: what an endpoint remembers about finished work is bounded by
age and by bytes, and its byte estimate is close to what Python really holds."""

import gc
import tracemalloc

import pytest

from kvhandoff.protocol import (
    MEMORY_BYTES,
    RETAIN_S,
    LocalOutcome,
    ParentKey,
    RecentMemory,
    RoundDecision,
    approx_bytes,
)
from kvhandoff.protocol._memory import _ENTRY_OVERHEAD


def _parent(i: int) -> ParentKey:
    return ParentKey(request_id=f"req-{i:08d}", ctx_attempt=i, gen_attempt=i)


def test_an_entry_is_kept_for_its_retention_and_then_forgotten() -> None:
    memory: RecentMemory[ParentKey, LocalOutcome] = RecentMemory(retain_s=10.0, max_bytes=1 << 20)
    memory.remember(_parent(1), LocalOutcome.COMPLETED, now=0.0)
    memory.remember(_parent(2), LocalOutcome.CANCELLED, now=5.0)
    assert memory.expire(10.0) == 0  # exactly at the bound: still kept
    assert memory[_parent(1)] is LocalOutcome.COMPLETED
    assert memory.expire(10.5) == 1
    assert _parent(1) not in memory and memory.get(_parent(2)) is LocalOutcome.CANCELLED
    # A write expires what aged out, too: a busy endpoint needs no sweep.
    memory.remember(_parent(3), LocalOutcome.FAILED, now=16.0)
    assert list(memory) == [_parent(3)]
    assert memory.stats()["dropped_by_age"] == 2 and memory.stats()["dropped_by_bytes"] == 0


def test_stats_at_a_time_do_not_report_what_has_aged_out_since_the_last_write() -> None:
    """An idle endpoint's stats say what it still remembers at the time asked,
    not what it held at its last write (a write-only expiry would report it)."""
    memory: RecentMemory[str, str] = RecentMemory(retain_s=10.0, max_bytes=1 << 20)
    memory.remember("a", "completed", 0.0)
    memory.remember("b", "completed", 4.0)
    assert memory.stats()["entries"] == 2  # no time given: nothing expires
    assert memory.stats(12.0) == {"entries": 1, "bytes": memory.nbytes, "dropped_by_age": 1, "dropped_by_bytes": 0}
    assert list(memory) == ["b"]


def test_a_write_refreshes_the_age_and_setdefault_keeps_the_first_value() -> None:
    memory: RecentMemory[str, str] = RecentMemory(retain_s=10.0, max_bytes=1 << 20)
    memory.remember("a", "admitted", 0.0)
    memory.remember("b", "admitted", 1.0)
    assert memory.setdefault("a", "completed", 9.0) == "admitted"  # first value wins ...
    memory.expire(10.5)
    assert list(memory.items()) == [("b", "admitted"), ("a", "admitted")]  # ... but its age restarted
    memory.expire(11.5)
    assert list(memory) == ["a"]
    assert memory.setdefault("c", "failed", 12.0) == "failed"
    assert memory.forget("a") == "admitted" and memory.forget("a") is None
    assert list(memory.values()) == ["failed"]


def test_the_byte_budget_drops_the_oldest_first_and_holds_exactly() -> None:
    memory: RecentMemory[ParentKey, str] = RecentMemory(retain_s=1e9, max_bytes=64 << 10)
    for i in range(5000):
        memory.remember(_parent(i), "completed", now=float(i))
        assert memory.nbytes <= 64 << 10
    kept = list(memory)
    assert 100 < len(kept) < 5000
    assert kept == [_parent(i) for i in range(5000 - len(kept), 5000)]  # the newest, in order
    assert memory.stats()["dropped_by_bytes"] == 5000 - len(kept)
    # The estimate stays exact through replacements and removals.
    for key in kept[:10]:
        memory.forget(key)
    memory.remember(kept[-1], "a much longer outcome string than before", now=6000.0)
    assert memory.nbytes == sum(approx_bytes(k) + approx_bytes(v) + _ENTRY_OVERHEAD for k, v in memory.items())


_VALUES = {
    "str": lambda i: f"completed-{i}",
    "enum": lambda i: LocalOutcome.COMPLETED,
    "list": lambda i: [float(i), float(i) + 1.0, i],
    "decision": lambda i: RoundDecision(round_no=i + 1, admitted=tuple(_parent(i * 3 + j) for j in range(3))),
}


@pytest.mark.parametrize("kind", sorted(_VALUES))
def test_the_byte_estimate_is_close_to_what_python_holds(kind: str) -> None:
    """The budget is in real bytes: the estimate of 2,000 entries is within
    [0.7, 1.5] of what they really hold."""
    n = 2000
    keys = [_parent(i) for i in range(n)]
    values = [_VALUES[kind](i) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        memory: RecentMemory[ParentKey, object] = RecentMemory(retain_s=1e9, max_bytes=1 << 30)
        for i, (k, v) in enumerate(zip(keys, values)):
            memory.remember(k, v, float(i))
        own = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # What the memory allocated itself (its dict, its tuples), plus the keys
    # and values it keeps alive (made before tracing started: measured apart).
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        again = [(_parent(i), _VALUES[kind](i)) for i in range(n)]
        kept_alive = tracemalloc.get_traced_memory()[0] - before - _list_bytes(again)
    finally:
        tracemalloc.stop()
    held = own + kept_alive
    assert 0.7 <= memory.nbytes / held <= 1.5, (memory.nbytes, held)


def _list_bytes(pairs: list[tuple[object, object]]) -> int:
    import sys

    return sys.getsizeof(pairs) + sum(sys.getsizeof(p) for p in pairs)


def test_defaults_and_bad_bounds() -> None:
    memory: RecentMemory[str, str] = RecentMemory()
    assert memory.retain_s == RETAIN_S and memory.max_bytes == MEMORY_BYTES
    for kwargs in ({"retain_s": 0.0}, {"retain_s": float("nan")}, {"max_bytes": 0}):
        with pytest.raises(ValueError):
            RecentMemory(**kwargs)  # type: ignore[arg-type]


def test_approx_bytes_counts_what_a_value_holds_of_its_own() -> None:
    assert approx_bytes(None) == 0 and approx_bytes(LocalOutcome.FAILED) == 0
    parent = _parent(1)
    assert approx_bytes(parent) > approx_bytes(parent.request_id) > 0
    decision = RoundDecision(round_no=1, admitted=(parent,) * 10)
    assert approx_bytes(decision) >= 10 * approx_bytes(parent)
