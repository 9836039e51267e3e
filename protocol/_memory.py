"""What a long-running endpoint remembers about finished work, bounded by need.

A rank or coordinator answers questions about work that already ended: a late
`wait` for an outcome, a cancel of a parent decided a moment ago, a debugging
look at recent round decisions. Such an answer is needed for as long as a
caller can still ask, which is bounded by the callers' own timeouts, not by a
count of entries: under traffic, a large entry count is a memory that grows for
hours before it levels off (a soak of an earlier build grew ~3 KiB per
handoff in every rank and coordinator).

`RecentMemory` keeps an entry for `retain_s` after it was last written and never
holds more than `max_bytes` (estimated per entry by `approx_bytes`); whichever
bound is reached first drops the oldest entries. Writes refresh an entry's age,
so insertion order is age order and dropping is O(1) per entry. Time is passed
in (this package reads no clock).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

__all__ = [
    "RecentMemory",
    "approx_bytes",
    "RETAIN_S",
    "MEMORY_BYTES",
]

#: How long a finished request's answers are kept by default: twice a
#: handoff's default timeout, so a caller's late question is still answered.
RETAIN_S = 120.0
#: Default byte budget of one memory (about 30,000 outcomes of ~250 bytes).
MEMORY_BYTES = 8 << 20

K = TypeVar("K")
V = TypeVar("V")

#: A dict slot, its share of the hash table and the (value, stamp, bytes)
#: tuple each entry is stored as, beyond the key and value themselves.
_ENTRY_OVERHEAD = 8 * 12 + sys.getsizeof((None, 0.0, 0)) + sys.getsizeof(0.0)


def approx_bytes(value: object, _depth: int = 0) -> int:
    """Bytes `value` holds of its own: the object, and for tuples, lists,
    frozensets, dicts and msgspec structs what they refer to (three levels
    deep). Singletons and enum members (shared by everyone) cost nothing."""
    kind = type(value)
    if kind in _LEAVES:  # the common case first: a key's or a field's atom
        return sys.getsizeof(value)
    if value is None or value is True or value is False or isinstance(value, enum.Enum):
        return 0
    size = sys.getsizeof(value)
    if _depth >= 3:
        return size
    depth = _depth + 1
    if kind in _SEQUENCES or isinstance(value, (tuple, list, frozenset, set)):
        for item in value:  # type: ignore[attr-defined]
            size += approx_bytes(item, depth)
        return size
    if isinstance(value, dict):
        for k, v in value.items():
            size += approx_bytes(k, depth) + approx_bytes(v, depth)
        return size
    fields = getattr(kind, "__struct_fields__", None)
    if fields is not None:
        for name in fields:
            size += approx_bytes(getattr(value, name), depth)
    return size


#: Types with nothing of their own to follow (bool is not one: its two
#: values are singletons); and the plain containers, tested by type first.
_LEAVES = frozenset({int, float, str, bytes})
_SEQUENCES = frozenset({tuple, list, frozenset, set})


class RecentMemory(Generic[K, V]):
    """An ordered map that forgets entries older than `retain_s` (since their
    last write) and keeps its estimated size within `max_bytes`."""

    __slots__ = ("retain_s", "max_bytes", "_entries", "_bytes", "dropped_by_age", "dropped_by_bytes")

    def __init__(self, *, retain_s: float = RETAIN_S, max_bytes: int = MEMORY_BYTES) -> None:
        if not retain_s > 0:
            raise ValueError(f"retain_s must be > 0, got {retain_s!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes!r}")
        self.retain_s = retain_s
        self.max_bytes = max_bytes
        self._entries: dict[K, tuple[V, float, int]] = {}
        self._bytes = 0
        self.dropped_by_age = 0
        self.dropped_by_bytes = 0

    def remember(self, key: K, value: V, now: float) -> None:
        """Store `value` under `key` (replacing any), as written at `now`."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[2]
        cost = approx_bytes(key) + approx_bytes(value) + _ENTRY_OVERHEAD
        self._entries[key] = (value, now, cost)
        self._bytes += cost
        self.expire(now)

    def setdefault(self, key: K, value: V, now: float) -> V:
        """The value under `key`, storing `value` first if there is none; either
        way the entry counts as written at `now`."""
        old = self._entries.get(key)
        kept = value if old is None else old[0]
        self.remember(key, kept, now)
        return kept

    def expire(self, now: float) -> int:
        """Drop entries last written more than `retain_s` before `now`, then the
        oldest ones while over `max_bytes`; returns how many were dropped."""
        dropped = 0
        entries = self._entries
        while entries:
            key = next(iter(entries))
            _, stamp, cost = entries[key]
            if now - stamp > self.retain_s:
                self.dropped_by_age += 1
            elif self._bytes > self.max_bytes:
                self.dropped_by_bytes += 1
            else:
                break
            del entries[key]
            self._bytes -= cost
            dropped += 1
        return dropped

    def forget(self, key: K) -> V | None:
        """Remove `key`; its value, or None if it was not remembered."""
        old = self._entries.pop(key, None)
        if old is None:
            return None
        self._bytes -= old[2]
        return old[0]

    def get(self, key: K, default: Any = None) -> Any:
        entry = self._entries.get(key)
        return default if entry is None else entry[0]

    def __getitem__(self, key: K) -> V:
        return self._entries[key][0]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def items(self) -> Iterator[tuple[K, V]]:
        """(key, value) pairs, oldest first."""
        return ((k, e[0]) for k, e in self._entries.items())

    def values(self) -> Iterator[V]:
        """Values, oldest first."""
        return (e[0] for e in self._entries.values())

    @property
    def nbytes(self) -> int:
        """The estimated bytes held (keys, values and per-entry overhead)."""
        return self._bytes

    def stats(self, now: float | None = None) -> dict[str, int]:
        """Counts and bytes; given `now`, entries past their age are dropped
        first, so a memory that was not written to lately does not report
        what it has already outlived."""
        if now is not None:
            self.expire(now)
        return {
            "entries": len(self._entries),
            "bytes": self._bytes,
            "dropped_by_age": self.dropped_by_age,
            "dropped_by_bytes": self.dropped_by_bytes,
        }
