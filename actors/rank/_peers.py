"""`RankCore`'s peers: its identity in the directory, the protocol negotiation
with each peer instance, the fleet's pairs as instances join and leave,
and the directory's notices about peer incarnations.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray

from kvhandoff.actors.rank._config import _Pair, log
from kvhandoff.actors.rank._state import _RankState
from kvhandoff.protocol import (
    Action,
    ContextTicket,
    Endpoint,
    FrameError,
    Message,
    Negotiated,
    NegotiationError,
    NegotiationOutcome,
    NotNegotiatedError,
    RankNamespace,
    Role,
    UnknownSessionError,
    agree,
    check_unnegotiated,
    encode_frame,
    frame_version,
    refusal_kind,
)
from kvhandoff.protocol import summary as negotiation_summary
from kvhandoff.topology import TopologySpec


class _Peers(_RankState):
    """Identity, directory, negotiation, peers and the fleet (a concern of `RankCore`)."""

    # -- identity, directory, peers ---------------------------------------------

    def _directory(self) -> Any:
        return ray.get_actor(f"{self.config.deployment}.directory")

    def _register(self) -> None:
        geometry = self.buffer.geometry()
        if self.arena is not None:
            geometry = geometry._replace(staging=(self.arena.base, self.arena.slot_bytes, self.config.staging_window))
        if self._lend_key:
            geometry = geometry._replace(lend_key=self._lend_key)
        entry = (self.our, self.transport.name, self.transport.metadata(), geometry)
        context = ray.get_runtime_context()
        where = (context.get_node_id(), os.getpid())  # to confirm this process's death later
        # Fire-and-forget: the directory only stores it; lookups wait for it.
        self._own(
            self._directory().register.remote(
                self.role.value, self.config.rank, entry, context.current_actor, where,
                descriptor=self._descriptor,
            )
        )

    # -- negotiation (the decisions are protocol/_negotiation.py's) ----------------

    @property
    def _negotiation(self) -> NegotiationOutcome:
        """The default pair's agreement (outside a fleet: the only one)."""
        pair = self._pairs.get(self._default_peer)
        return pair.negotiation if pair is not None else NotNegotiatedError(0, 1)

    async def _negotiate(self, pair: _Pair) -> NegotiationOutcome:
        """Gather the descriptor of every rank of both instances of `pair` from
        the directory (ours from our config), let `agree` decide, apply the answer."""
        pair.seq[0] += 1
        seq = pair.seq[0]
        known = await self._directory().descriptors.remote()
        known[(self.ns.instance_id, self.config.rank)] = self._descriptor
        # The same order on every rank of both instances (CTX ranks, then GEN
        # ranks): same frames, same answer, and the same words in a refusal.
        specs = (self.config.spec, pair.spec) if self.role is Role.CTX else (pair.spec, self.config.spec)
        frames = [known.get((s.instance_id, r)) for s in specs for r in range(s.tp)]
        outcome: NegotiationOutcome
        try:
            outcome = agree(frames)
        except NegotiationError as exc:
            outcome = exc
        if seq > pair.seq[1]:  # an older, slower query never replaces a newer answer
            pair.seq[1] = seq
            before = negotiation_summary(pair.negotiation)
            pair.negotiation = outcome
            self._negotiated(outcome)
            if negotiation_summary(outcome) != before:
                log.info("rank %s: negotiation with %s: %s", self.ns, pair.instance, negotiation_summary(outcome))
        return pair.negotiation

    def _renegotiate(self, pair: _Pair) -> None:
        """Negotiate `pair` again in an owned task (once more if asked while one
        runs); then send what waited for the answer, in order."""
        if pair.negotiating:
            pair.again = True
            return
        pair.negotiating = True

        async def run() -> None:
            try:
                pair.again = True
                while pair.again:
                    pair.again = False
                    await self._negotiate(pair)
            finally:
                pair.negotiating = False
                unsent, pair.unsent = pair.unsent, []
                for to, message in unsent:
                    frame = self._encode(message)
                    if frame is not None:
                        self._send(to, frame)

        self._own(run())

    async def _await_agreement(self, pair: _Pair) -> None:
        """A frame came before an agreement (a restarted rank's first moments):
        negotiate now. Frames wait in arrival order (the lock is FIFO, and a
        frame that comes while others wait queues behind them)."""
        self._gate_waiting += 1
        try:
            async with self._frame_gate:
                if isinstance(pair.negotiation, NotNegotiatedError):
                    await self._negotiate(pair)
        except Exception as exc:  # the directory did not answer: still no agreement, refused
            self.counters["negotiation_lookup_failed"] += 1
            log.warning("rank %s: negotiation failed: %r", self.ns, exc)
        finally:
            self._gate_waiting -= 1

    def _peer_ns(self, ticket: ContextTicket) -> RankNamespace:
        """The peer rank a ticket names, seen from our role."""
        return ticket.gen.ns if self.role is Role.CTX else ticket.ctx.ns

    def _pair_for(self, message: Message) -> _Pair:
        """The pair a received frame belongs to: the peer instance its ticket
        names. A frame naming an instance we do not pair with is refused."""
        ticket = getattr(message, "ticket", None)
        if not isinstance(ticket, ContextTicket):  # e.g. a descriptor frame: not a control frame
            raise UnknownSessionError(f"a {type(message).__name__} is not a control frame for a session")
        ns = self._peer_ns(ticket)
        pair = self._pairs.get(ns.instance_id)
        if pair is None or ns.role is not self.peer_role:
            raise UnknownSessionError(f"{ns.role.value} instance {ns.instance_id!r} does not pair with {self.ns.instance_id!r}")
        return pair

    def _check_agreed(self, pair: _Pair, message: Message, version: int) -> None:
        """With the pair's agreement, a frame of another version is refused
        (`FrameError`); without one every frame but a REJECT is refused, typed
        (an OPEN addressed to us is then answered REJECT(NEGOTIATION))."""
        outcome = pair.negotiation
        if isinstance(outcome, Negotiated):
            if version != outcome.version:
                raise FrameError(f"frame is protocol v{version} but v{outcome.version} was negotiated")
            return
        try:
            check_unnegotiated(outcome, message)
        except NegotiationError as exc:
            self.counters[f"refused_negotiation_{refusal_kind(exc)}"] += 1
            raise

    def _encode(self, message: Message, answering: int | None = None) -> bytes | None:
        """Encode in the pair's agreed version; without an agreement only an
        OPEN or a REJECT (in the version of the frame it answers) is written;
        anything else is not sent (counted)."""
        pair = self._pairs.get(self._peer_ns(message.ticket).instance_id)  # type: ignore[union-attr]
        outcome = pair.negotiation if pair is not None else NotNegotiatedError(0, 1)
        try:
            version = frame_version(outcome, message, answering=answering)
            return encode_frame(message, version=version)
        except NegotiationError as exc:
            self.counters[f"unsent_negotiation_{refusal_kind(exc)}"] += 1
            return None

    async def _peer(self, their: Endpoint) -> Any:
        key = (their.ns.instance_id, their.ns.rank)
        cached = self._peer_handles.get(key)
        if cached is not None and cached[0] == their:
            return cached[1]
        # Wait (bounded) for `their` incarnation: its first frame can come
        # before its registration reaches the directory (a rank that just
        # joined or restarted), and the entry there is then an older one.
        found = await self._directory().lookup.remote(key[0], key[1], their.epoch, self.config.lease_timeout_s)
        if found is None:
            raise UnknownSessionError(f"no rank actor registered for {their}")
        (endpoint, name, metadata, geometry), handle = found
        self._peer_handles[key] = (endpoint, handle)
        self._learn_agent(name, metadata, geometry)
        if endpoint != their:
            return None  # the peer restarted: the message is stale
        return handle

    async def connect(self) -> list[Endpoint]:
        """Learn every current peer endpoint of the default pair (and, on CTX,
        its NIXL agents) and negotiate with it; in a fleet, also learn every
        instance of the other role from the directory's instance table and
        negotiate with each (their agents are loaded on first use)."""
        directory = self._directory()
        if self.config.fleet:
            listed = await directory.instances.remote()
            present = {spec.instance_id for spec, _ in listed}
            for spec, kind in listed:
                self._add_pair(spec, kind)
            for instance in [i for i in self._pairs if i not in present]:
                self._drop_pair(instance)  # left while we were away
        endpoints = []
        if self._default_peer in self._pairs:
            for (endpoint, name, metadata, geometry), handle in await directory.all_of.remote(self._default_peer):
                self._peer_handles[(endpoint.ns.instance_id, endpoint.ns.rank)] = (endpoint, handle)
                self._learn_agent(name, metadata, geometry)
                endpoints.append(endpoint)
        # Every rank has registered by now (or is being restarted).
        await asyncio.gather(*(self._negotiate(pair) for pair in list(self._pairs.values())))
        self._export_metrics(time.monotonic())  # the pool gauges, before any traffic
        return endpoints

    # -- the fleet: pairs with instances that join and leave --------------------------

    def _add_pair(self, spec: TopologySpec, kind: str) -> _Pair | None:
        """Pair with instance `spec` (of the other role) if we do not yet."""
        if spec.role is not self.peer_role or spec.instance_id in self._pairs:
            return self._pairs.get(spec.instance_id)
        pair = self._pairs[spec.instance_id] = _Pair(self.config.spec, spec, self.config.layout, kind)
        self.counters["pairs_added"] += 1
        return pair

    def _drop_pair(self, instance: str) -> None:
        """Forget instance `instance`: no new admission pairs with it; its NIXL
        agents are unloaded once no live parent pairs with it (a WRITE may be
        in flight toward, or from, an agent until then)."""
        pair = self._pairs.get(instance)
        if pair is None:
            return
        if not pair.left:
            pair.left = True
            # Whatever still pairs with it ends now, not at a deadline: a
            # drained instance has none; a dead one leaves its handoffs
            # behind. A cancel intent: the round decides, the protocol
            # drains or proves what is in flight (nothing is freed here).
            for parent in [p for p, peer in self._pair_of.items() if peer == instance]:
                self.member.record_cancel(parent)
                self.counters["cancelled_peer_left"] += 1
                self._nudge()
        if any(peer == instance for peer in self._pair_of.values()):
            return  # unloaded when the last parent with it ends (`_finish`)
        if self._writing_to(instance):
            # A WRITE toward it is not polled to DONE or ERR yet (a parent
            # quarantined on it has ended here, its chunks have not). Its
            # agent stays loaded until the last one ends: unloading a peer
            # under a transfer is no abort, and that handle would never end,
            # so neither would the quarantine it keeps (the poll retries).
            self.counters["unload_deferred_in_flight"] += 1
            return
        del self._pairs[instance]
        for key in [k for k in self._peer_handles if k[0] == instance]:
            del self._peer_handles[key]
        if self._streams is not None:
            self._streams.forget(lambda e: e.ns.instance_id != instance)
        # Every agent of the instance, older incarnations' included (a
        # `peer_restarted` notice forgets the handle, not the loaded agent).
        prefix = f"{self.config.deployment}.{instance}."
        for name in sorted(n for n in self.transport.peers if n.startswith(prefix)):
            self.transport.remove_peer(name)
            self.counters["agents_unloaded"] += 1
        self._pair_left(instance)
        self.counters["pairs_removed"] += 1

    def _pair_left(self, instance: str) -> None:
        """The role's own per-pair state of `instance` goes (its pair was dropped)."""

    def _writing_to(self, instance: str) -> bool:
        """Whether a WRITE we posted toward a rank of `instance` is not yet
        polled to DONE or ERR (or a chunk toward it waits to be posted)."""
        return False

    def _drop_left_pairs(self) -> None:
        """Retry unloading pairs that left while WRITEs toward them ran."""
        for instance in [i for i, p in self._pairs.items() if p.left]:
            self._drop_pair(instance)

    async def peer_joined(self, spec: TopologySpec, kind: str) -> bool:
        """The directory says instance `spec` joined the fleet: pair with it
        and negotiate (its ranks registered their descriptors before it was
        added). Refused (False) outside a fleet, for our own role, or when
        the instance is known already."""
        if not self.config.fleet or spec.role is not self.peer_role or spec.instance_id in self._pairs:
            self.counters["refused_peer_joined"] += 1
            return False
        pair = self._add_pair(spec, kind)
        assert pair is not None
        await self._negotiate(pair)
        return True

    async def peer_left(self, instance: str) -> bool:
        """The directory says instance `instance` left the fleet (drained, or
        removed after its death): admit nothing more with it and unload its
        agents once nothing with it is live."""
        if instance not in self._pairs:
            return False
        self._drop_pair(instance)
        return True

    async def paired_with(self, instance: str) -> int:
        """How many live parents here pair with peer instance `instance` (a
        drain waits for 0 on every rank of the other role)."""
        return sum(1 for peer in self._pair_of.values() if peer == instance)

    async def pairs(self) -> dict[str, Any]:
        """Every pair: the peer instance's TP, whether it left, the agreement."""
        return {
            i: {"tp": p.spec.tp, "left": p.left, "negotiated": negotiation_summary(p.negotiation)}
            for i, p in self._pairs.items()
        }

    async def peer_restarted(self, their: Endpoint) -> int:
        """The directory saw a peer rank come back as `their` (a newer epoch):
        our sessions with its older incarnations can never finish. The protocol
        decides what that means (edges with unproven DMA become UNKNOWN and
        their blocks quarantined; the rest are cancelled); returns the number
        of actions it produced. A notice that is not about a peer rank of ours,
        or about an epoch we already know, changes nothing."""
        if not self._about_a_peer(their, "peer_restarted"):
            return 0
        key = (their.ns.instance_id, their.ns.rank)
        cached = self._peer_handles.get(key)
        if cached is not None and cached[0].epoch < their.epoch:
            del self._peer_handles[key]  # the next send resolves the new incarnation
        if self._streams is not None:  # no frame goes to an older incarnation's stream
            self._streams.forget(lambda e: (e.ns.instance_id, e.ns.rank) != key or e.epoch >= their.epoch)
        self._renegotiate(self._pairs[their.ns.instance_id])  # it re-registers with its descriptor
        return self._perform_notice(self.side.peer_restarted(their, time.monotonic()), "peer_restarts_seen")

    def _about_a_peer(self, endpoint: Endpoint, notice: str) -> bool:
        """A notice names a rank of our peer instance, or it is refused (counted)."""
        if endpoint.ns.role is self.peer_role and endpoint.ns.instance_id in self._pairs:
            return True
        self.counters[f"refused_{notice}"] += 1
        return False

    def _perform_notice(self, actions: list[Action], seen: str) -> int:
        self.counters[seen] += 1
        self._perform(actions)
        self._ensure_polling()
        return len(actions)

    def _find_coordinator(self) -> bool:
        if self._coordinator is None:
            name = self.config.coordinator or f"{self.config.deployment}.coord.{self.role.value}"
            try:
                self._coordinator = ray.get_actor(name)
            except ValueError:  # not up yet: the next round carries the news anyway
                return False
        return True

    async def peer_dead(self, dead: Endpoint) -> int:
        """The directory reports peer incarnation `dead` confirmed dead (its
        coordinator killed it and Ray reported the actor gone). On GEN that is
        the proof that nothing it posted can still land: its edges, UNKNOWN ones
        included, are quiescent, and quarantined requests that waited only on
        it are reclaimed. On CTX it ends the quarantine of edges toward it
        whose WRITEs all ended at their poll (an ERR of several descriptors
        included: the rest can land only in the dead process). Refused like
        `peer_restarted` when not about a peer."""
        if not self._about_a_peer(dead, "peer_dead"):
            return 0
        return self._perform_notice(self.side.peer_dead(dead, time.monotonic()), "peer_deaths_seen")
