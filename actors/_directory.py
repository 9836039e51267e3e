"""`Directory`: where a deployment's rank actors find each other.

One named actor per deployment (`<deployment>.directory`). A rank actor
registers its current endpoint (with its endpoint epoch), NIXL agent name and
metadata, and its handle when it starts; a restarted rank registers again with
a new epoch and replaces the old entry. The directory tells every rank of the
other role (`peer_restarted`) as soon as an incarnation is known dead: when its
coordinator retires it (`retire`, before the replacement starts), and again
when the replacement registers; sessions with the dead incarnation end then,
instead of at their transfer timeout. Once the retired incarnation is
confirmed dead (`retire` waits for it: Ray reports the actor dead and, when it
ran on this node, its process is gone), the peers hear `peer_dead`: the proof
that lets a GEN rank reclaim blocks that the dead writer left quarantined
(docs/design.md "Quarantine and reclaim"). Peers resolve an `Endpoint`
through it and compare epochs: a message for an older incarnation is stale,
never merely late (docs/design.md "Identity"). Each registration also
carries the rank's protocol descriptor (an encoded descriptor frame), kept
beside its entry (`descriptors`): every rank negotiates the protocol from the
descriptors of every rank of both instances (docs/design.md "Negotiation").
The directory decides nothing else.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from kvhandoff.protocol import Endpoint

__all__ = ["Directory", "DirectoryCore"]

Entry = tuple[Any, str, bytes, Any]  # (Endpoint, agent name, agent metadata, BufferGeometry)


class DirectoryCore:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], tuple[Entry, Any]] = {}
        # (role, rank) -> the current incarnation's descriptor frame (beside
        # `_entries`, so that `lookup`/`all_of` answers keep their shape).
        self._descriptors: dict[tuple[str, int], bytes] = {}
        # (role, rank, epoch) -> (node id, pid) of that incarnation's process.
        self._where: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._node = ray.get_runtime_context().get_node_id()
        self.deaths_confirmed = 0
        self._changed = asyncio.Event()
        self._lookup_delay_s = 0.0

    async def set_lookup_delay(self, seconds: float) -> None:
        """Fault injection (tests): every `lookup` answers `seconds` late, as a
        loaded directory would. Registration and `all_of` are not delayed."""
        self._lookup_delay_s = max(0.0, float(seconds))

    async def register(
        self,
        role: str,
        rank: int,
        entry: Entry,
        handle: Any,
        where: tuple[str, int] | None = None,
        descriptor: bytes | None = None,
    ) -> None:
        if where is not None:
            self._where[(role, rank, entry[0].epoch)] = where
        current = self._entries.get((role, rank))
        if current is not None and current[0][0].epoch > entry[0].epoch:
            return  # an older incarnation registering late never replaces a newer one
        self._entries[(role, rank)] = (entry, handle)
        if descriptor is None:
            self._descriptors.pop((role, rank), None)  # unknown: nobody negotiates with a stale one
        else:
            self._descriptors[(role, rank)] = descriptor
        self._changed.set()
        if current is not None and current[0][0].epoch < entry[0].epoch:
            # A restart: every rank of the other role learns now that the old
            # incarnation is gone (its sessions can never finish), rather than
            # through a transfer timeout. Fire-and-forget: a rank that misses
            # it still has that timeout.
            self._tell_peers(role, "peer_restarted", entry[0])

    async def retire(self, role: str, rank: int, epoch: int, confirm_timeout_s: float = 120.0) -> int:
        """Incarnation `epoch` of (`role`, `rank`) was killed by its coordinator:
        tell every rank of the other role now (`peer_restarted`: its sessions can
        never finish), then, once the death is confirmed, `peer_dead`. Returns
        how many ranks heard `peer_dead` (0 if unconfirmed within the bound)."""
        found = self._entries.get((role, rank))
        if found is None:
            return 0
        ns = found[0][0].ns
        if found[0][0].epoch <= epoch:  # not replaced yet: the replacement's register tells too
            self._tell_peers(role, "peer_restarted", Endpoint(ns=ns, epoch=epoch + 1))
        handle = found[1] if found[0][0].epoch == epoch else None  # None: already replaced
        if not await self._confirm_dead(role, rank, epoch, handle, confirm_timeout_s):
            return 0
        self.deaths_confirmed += 1
        return self._tell_peers(role, "peer_dead", Endpoint(ns=ns, epoch=epoch))

    async def _confirm_dead(self, role: str, rank: int, epoch: int, handle: Any, bound: float) -> bool:
        """Wait until incarnation `epoch` is gone: Ray answers a call to it with
        ActorDiedError (the GCS marked it dead after ray.kill), and, when its
        process ran on this node, that process no longer exists (the DEAD mark
        can precede the exit by a moment). Waits on those conditions, bounded."""
        deadline = time.monotonic() + bound
        if handle is not None:
            while True:
                try:
                    await asyncio.wait_for(handle.round_identity.remote(), max(0.01, deadline - time.monotonic()))
                except ActorDiedError:
                    break
                except Exception:  # unavailable / slow: not proof either way
                    pass
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.05)
        where = self._where.pop((role, rank, epoch), None)
        if where is None:
            return handle is not None
        node, pid = where
        if node != self._node:
            return handle is not None  # another node: Ray's DEAD mark is the proof we have
        while _pid_alive(pid):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _tell_peers(self, role: str, notice: str, endpoint: Endpoint) -> int:
        """Send `notice` about `endpoint` to every rank of the other role
        (fire-and-forget). `peer_restarted(newer)`: an incarnation newer than
        any you have sessions with, end those with every older epoch;
        `peer_dead(dead)`: that incarnation is confirmed dead."""
        told = 0
        for (other, _), (_, peer) in self._entries.items():
            if other != role:
                getattr(peer, notice).remote(endpoint)
                told += 1
        return told

    async def lookup(self, role: str, rank: int) -> tuple[Entry, Any] | None:
        if self._lookup_delay_s:
            await asyncio.sleep(self._lookup_delay_s)
        return self._entries.get((role, rank))

    async def descriptors(self) -> dict[tuple[str, int], bytes]:
        """Every registered rank's descriptor frame, by (role, rank): the
        current incarnation's (a late, older registration never replaces it)."""
        return dict(self._descriptors)

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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) runs nothing: count it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


Directory = ray.remote(num_cpus=0)(DirectoryCore)
