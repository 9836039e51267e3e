"""`Directory`: where a deployment's rank actors find each other.

One named actor per deployment (`<deployment>.directory`). A rank actor
registers its current endpoint (with its endpoint epoch), NIXL agent name and
metadata, and its handle when it starts; a restarted rank registers again with
a new epoch and replaces the old entry. Peers resolve an `Endpoint` through it
and compare epochs: a message for an older incarnation is stale, never merely
late (DESIGN.md "Identity"). The directory decides nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

__all__ = ["Directory", "DirectoryCore"]

Entry = tuple[Any, str, bytes, Any]  # (Endpoint, agent name, agent metadata, BufferGeometry)


class DirectoryCore:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], tuple[Entry, Any]] = {}
        self._changed = asyncio.Event()
        self._lookup_delay_s = 0.0

    async def set_lookup_delay(self, seconds: float) -> None:
        """Fault injection (tests): every `lookup` answers `seconds` late, as a
        loaded directory would. Registration and `all_of` are not delayed."""
        self._lookup_delay_s = max(0.0, float(seconds))

    async def register(self, role: str, rank: int, entry: Entry, handle: Any) -> None:
        current = self._entries.get((role, rank))
        if current is not None and current[0][0].epoch > entry[0].epoch:
            return  # an older incarnation registering late never replaces a newer one
        self._entries[(role, rank)] = (entry, handle)
        self._changed.set()

    async def lookup(self, role: str, rank: int) -> tuple[Entry, Any] | None:
        if self._lookup_delay_s:
            await asyncio.sleep(self._lookup_delay_s)
        return self._entries.get((role, rank))

    async def all_of(self, role: str) -> list[tuple[Entry, Any]]:
        return [v for (r, _), v in sorted(self._entries.items()) if r == role]

    async def wait_for(self, expected: dict[str, list[int]], timeout: float) -> bool:
        """Wait until every (role, rank) has registered at least the given epoch."""

        def ready() -> bool:
            for role, epochs in expected.items():
                for rank, epoch in enumerate(epochs):
                    found = self._entries.get((role, rank))
                    if found is None or found[0][0].epoch < epoch:
                        return False
            return True

        async def poll() -> None:
            while not ready():
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(poll(), timeout)
        except TimeoutError:
            return False
        return True


Directory = ray.remote(num_cpus=0)(DirectoryCore)
