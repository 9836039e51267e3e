"""`Directory`: where a deployment's rank actors find each other.

One named actor per deployment (`<deployment>.directory`). A rank actor
registers its current endpoint (with its endpoint epoch), NIXL agent name and
metadata, and its handle when it starts; a restarted rank registers again with
a new epoch and replaces the old entry. The directory tells every rank of the
other role (`peer_restarted`) as soon as an incarnation is known dead: when its
coordinator retires it (`retire`, before the replacement starts), and again
when the replacement registers; sessions with the dead incarnation end then,
instead of at their transfer timeout. Peers resolve an `Endpoint`
through it and compare epochs: a message for an older incarnation is stale,
never merely late (DESIGN.md "Identity"). The directory decides nothing else.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from kvhandoff.protocol import Endpoint

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
        if current is not None and current[0][0].epoch < entry[0].epoch:
            # A restart: every rank of the other role learns now that the old
            # incarnation is gone (its sessions can never finish), rather than
            # through a transfer timeout. Fire-and-forget: a rank that misses
            # it still has that timeout.
            self._tell_peers(role, entry[0])

    async def retire(self, role: str, rank: int, epoch: int) -> int:
        """Incarnation `epoch` of (`role`, `rank`) is dead (its coordinator killed
        it): tell every rank of the other role now, before the replacement has
        even started. Returns how many ranks were told."""
        found = self._entries.get((role, rank))
        if found is None or found[0][0].epoch > epoch:
            return 0  # unknown, or already replaced (the replacement's register told them)
        return self._tell_peers(role, Endpoint(ns=found[0][0].ns, epoch=epoch + 1))

    def _tell_peers(self, role: str, newer: Endpoint) -> int:
        # `newer` stands for "an incarnation newer than any you have sessions
        # with"; ranks end their sessions with every older epoch.
        told = 0
        for (other, _), (_, peer) in self._entries.items():
            if other != role:
                peer.peer_restarted.remote(newer)
                told += 1
        return told

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
