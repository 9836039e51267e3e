"""`Directory`: where a deployment's rank actors find each other.

One named actor per deployment or fleet (`<deployment>.directory`); entries
are keyed by (instance id, rank), so a fleet's many instances of each role
share it. It also keeps the fleet's instance table (`add_instance`,
`remove_instance`, `instances`): each instance's topology spec and memory
kind, from which a rank builds what it needs to pair with a peer instance,
and it tells the ranks of the other role when an instance joins
(`peer_joined`) or leaves (`peer_left`). A rank actor
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

from kvhandoff.actors._faults import DirectoryFaults, FaultPlan
from kvhandoff.protocol import Endpoint

__all__ = ["Directory", "DirectoryCore"]

Entry = tuple[Any, str, bytes, Any]  # (Endpoint, agent name, agent metadata, BufferGeometry)


class DirectoryCore:
    def __init__(self, fault_plan: FaultPlan | None = None) -> None:
        # (instance id, rank) -> the current incarnation's entry and handle.
        self._entries: dict[tuple[str, int], tuple[Entry, Any]] = {}
        # (instance id, rank) -> the current incarnation's descriptor frame
        # (beside `_entries`, so that `lookup`/`all_of` answers keep their shape).
        self._descriptors: dict[tuple[str, int], bytes] = {}
        # (instance id, rank, epoch) -> (node id, pid) of that incarnation's process.
        self._where: dict[tuple[str, int, int], tuple[str, int]] = {}
        # The fleet's instances: id -> (TopologySpec, memory kind), and which
        # ids left (a late registration of a removed instance is refused).
        self._instances: dict[str, tuple[Any, str]] = {}
        self._removed: set[str] = set()
        self._node = ray.get_runtime_context().get_node_id()
        self.deaths_confirmed = 0
        self._changed = asyncio.Event()
        #: Fault injection (actors/_faults.py), only for a deployment launched
        #: with a `FaultPlan`: `lookup` answers late, as a loaded directory would.
        self.faults = DirectoryFaults() if fault_plan is not None else None

    async def register(
        self,
        role: str,
        rank: int,
        entry: Entry,
        handle: Any,
        where: tuple[str, int] | None = None,
        descriptor: bytes | None = None,
    ) -> None:
        instance = entry[0].ns.instance_id
        if instance in self._removed:
            return  # the instance left the fleet: a late incarnation never comes back
        key = (instance, rank)
        if where is not None:
            self._where[(instance, rank, entry[0].epoch)] = where
        current = self._entries.get(key)
        if current is not None and current[0][0].epoch > entry[0].epoch:
            return  # an older incarnation registering late never replaces a newer one
        self._entries[key] = (entry, handle)
        if descriptor is None:
            self._descriptors.pop(key, None)  # unknown: nobody negotiates with a stale one
        else:
            self._descriptors[key] = descriptor
        self._changed.set()
        if current is not None and current[0][0].epoch < entry[0].epoch:
            # A restart: every rank of the other role learns now that the old
            # incarnation is gone (its sessions can never finish), rather than
            # through a transfer timeout. Fire-and-forget: a rank that misses
            # it still has that timeout.
            self._tell_peers(role, "peer_restarted", entry[0])

    async def retire(self, instance: str, rank: int, epoch: int, confirm_timeout_s: float = 120.0) -> int:
        """Incarnation `epoch` of (`instance`, `rank`) was killed by its coordinator:
        tell every rank of the other role now (`peer_restarted`: its sessions can
        never finish), then, once the death is confirmed, `peer_dead`. Returns
        how many ranks heard `peer_dead` (0 if unconfirmed within the bound)."""
        found = self._entries.get((instance, rank))
        if found is None:
            return 0
        ns = found[0][0].ns
        role = ns.role.value
        if found[0][0].epoch <= epoch:  # not replaced yet: the replacement's register tells too
            self._tell_peers(role, "peer_restarted", Endpoint(ns=ns, epoch=epoch + 1))
        handle = found[1] if found[0][0].epoch == epoch else None  # None: already replaced
        if not await self._confirm_dead(instance, rank, epoch, handle, confirm_timeout_s):
            return 0
        self.deaths_confirmed += 1
        return self._tell_peers(role, "peer_dead", Endpoint(ns=ns, epoch=epoch))

    async def _confirm_dead(self, instance: str, rank: int, epoch: int, handle: Any, bound: float) -> bool:
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
        where = self._where.pop((instance, rank, epoch), None)
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

    def _tell_peers(self, role: str, notice: str, *about: Any) -> int:
        """Send `notice` about `endpoint` to every rank of the other role
        (fire-and-forget). `peer_restarted(newer)`: an incarnation newer than
        any you have sessions with, end those with every older epoch;
        `peer_dead(dead)`: that incarnation is confirmed dead."""
        told = 0
        for (entry, peer) in list(self._entries.values()):
            if entry[0].ns.role.value != role:
                getattr(peer, notice).remote(*about)
                told += 1
        return told

    # -- the fleet's instances -------------------------------------------------------

    async def add_instance(self, spec: Any, memory_kind: str) -> None:
        """An instance joins: remember its spec and memory kind (a rank reads
        `instances()` on `connect`; the fleet client tells the live ranks of
        the other role itself and awaits them, `peer_joined`, so the instance
        serves only once they paired with it). A removed id never comes back."""
        instance = spec.instance_id
        if instance in self._removed:
            raise ValueError(f"instance {instance!r} left this fleet; a replacement needs a new id")
        self._instances[instance] = (spec, memory_kind)

    async def remove_instance(self, instance: str) -> list[Any]:
        """An instance left (drained or dead): forget it and its ranks' entries,
        tell every rank of the other role (`peer_left`: unload its agents and
        forget the pair). Returns the removed ranks' handles."""
        found = self._instances.pop(instance, None)
        self._removed.add(instance)
        handles = []
        for key in [k for k in self._entries if k[0] == instance]:
            handles.append(self._entries.pop(key)[1])
            self._descriptors.pop(key, None)
        if found is not None:
            self._tell_peers(found[0].role.value, "peer_left", instance)
        self._changed.set()
        return handles

    async def instances(self) -> list[tuple[Any, str]]:
        """Every instance in the fleet: (TopologySpec, memory kind)."""
        return list(self._instances.values())

    async def lookup(self, instance: str, rank: int, epoch: int = 0, timeout: float = 0.0) -> tuple[Entry, Any] | None:
        """The current entry of (`instance`, `rank`), or None. With `epoch`,
        wait up to `timeout` until that incarnation (or a newer one) has
        registered: a frame from a rank can reach a peer before the rank's own
        registration reaches us (both are one-way calls from different
        callers). An instance that left answers at once."""
        if self.faults is not None:
            await self.faults.before_lookup(instance)

        def ready() -> bool:
            found = self._entries.get((instance, rank))
            return instance in self._removed or (found is not None and found[0][0].epoch >= epoch)

        if epoch and timeout > 0:
            await self._until(ready, timeout)
        return self._entries.get((instance, rank))

    async def descriptors(self) -> dict[tuple[str, int], bytes]:
        """Every registered rank's descriptor frame, by (instance id, rank): the
        current incarnation's (a late, older registration never replaces it)."""
        return dict(self._descriptors)

    async def all_of(self, who: str) -> list[tuple[Entry, Any]]:
        """The entries of one instance (by id), or of every instance of a role
        ("ctx" / "gen"), ordered by (instance, rank)."""
        return [
            v
            for (instance, _), v in sorted(self._entries.items())
            if instance == who or v[0][0].ns.role.value == who
        ]

    async def wait_for(self, expected: dict[str, list[int]], timeout: float) -> bool:
        """Wait until every (instance id, rank) has registered at least the given epoch."""

        def ready() -> bool:
            for instance, epochs in expected.items():
                for rank, epoch in enumerate(epochs):
                    found = self._entries.get((instance, rank))
                    if found is None or found[0][0].epoch < epoch:
                        return False
            return True

        return await self._until(ready, timeout)

    async def _until(self, ready: Any, timeout: float) -> bool:
        """Wait until `ready()` holds (re-checked at every registration or
        removal), at most `timeout` seconds; whether it holds."""

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
