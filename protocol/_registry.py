"""Default-deny session registries (docs/design.md "Identity", "Slots, leases, ownership").

Theory of operation
-------------------
A registry maps exact `ContextTicket`s to the session state of one rank. It is
default-deny: a lookup succeeds only for a ticket equal, field by field, to an
installed one. Anything else raises, and raising never changes state (S3):

* `StaleError` when the ticket shares its request id with a session this
  registry installed (now or recently): it names an older/other attempt,
  endpoint epoch, rank namespace or topology digest, or a session that was
  closed. The error names the first field that differs.
* `UnknownSessionError` when the request id was never seen here (or was
  forgotten long ago).

Closed sessions are remembered in a bounded record of how they ended (like
h2's `_closed_streams`), so that a late CANCEL or RECEIPT for a released
session is classified as stale, not unknown.

`check_descriptor()` is the slot-generation half of default-deny: a
`BlockDescriptor` whose `(block, generation)` is not a current incarnation in
the pool is stale. `check_descriptors()` checks a whole OPEN's list at once,
as arrays (an OPEN may name thousands of blocks).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from ._errors import ProtocolError, StaleError, UnknownSessionError
from ._messages import BlockDescriptor
from ._pool import BlockPool, BlockRef
from ._ticket import ContextTicket

__all__ = [
    "DuplicateSessionError",
    "SessionRegistry",
    "CLOSED_SESSION_MEMORY",
    "stale_field",
    "check_descriptor",
    "check_descriptors",
]

#: How many closed sessions a registry remembers for stale classification.
CLOSED_SESSION_MEMORY = 8192
#: Distinct endpoints and digests a registry shares among the closed sessions
#: it remembers (a handful per peer incarnation); past this the table starts over.
_SHARED_PARTS = 1024

V = TypeVar("V")

# The fields compared, in the order a stale error reports them. request_id is
# the key, so it is never the differing field.
_FIELDS: tuple[tuple[str, str], ...] = (
    ("ctx_attempt", "ctx attempt"),
    ("gen_attempt", "gen attempt"),
    ("ctx", "ctx endpoint"),
    ("gen", "gen endpoint"),
    ("ctx_digest", "ctx topology digest"),
    ("gen_digest", "gen topology digest"),
)


class DuplicateSessionError(ProtocolError):
    """A session is installed twice under the same ticket (answer: REJECT DUPLICATE)."""

    def __init__(self, ticket: ContextTicket) -> None:
        super().__init__(f"session already installed: {ticket.request_id} edge {ticket.edge}")
        self.ticket = ticket


def stale_field(got: ContextTicket, expected: ContextTicket) -> tuple[str, object, object] | None:
    """The first field in which `got` differs from `expected`, as (name, got, expected)."""
    for attr, name in _FIELDS:
        mine, theirs = getattr(got, attr), getattr(expected, attr)
        if mine != theirs:
            if attr in ("ctx", "gen"):
                # Say whether the namespace or only the epoch moved: an epoch
                # change is a restarted rank, a namespace change a wrong peer.
                if mine.ns != theirs.ns:
                    return (f"{attr} namespace", mine.ns, theirs.ns)
                return (f"{attr} epoch", mine.epoch, theirs.epoch)
            return (name, mine, theirs)
    return None


def check_descriptor(pool: BlockPool, descriptor: BlockDescriptor) -> BlockRef:
    """Return the BlockRef a descriptor names, or raise StaleError if it is not current."""
    ref = BlockRef(descriptor.block, descriptor.generation)
    if not pool.is_current(ref):
        current = (
            pool.generation_of(descriptor.block)
            if 0 <= descriptor.block < pool.num_blocks
            else None
        )
        raise StaleError(
            "slot generation",
            (descriptor.block, descriptor.generation),
            (descriptor.block, current),
        )
    return ref


def check_descriptors(pool: BlockPool, blocks: np.ndarray, generations: np.ndarray) -> None:
    """`check_descriptor` for a whole OPEN at once (its `block_columns`):
    raise StaleError naming the first (block, generation) that is not a
    current incarnation in `pool`."""
    current = pool.current(blocks.astype(np.int64), generations.astype(np.int64))
    if not current.all():
        i = int(np.argmin(current))
        block, generation = int(blocks[i]), int(generations[i])
        now = pool.generation_of(block) if 0 <= block < pool.num_blocks else None
        raise StaleError("slot generation", (block, generation), (block, now))


class SessionRegistry(Generic[V]):
    """Exact-ticket map with stale/unknown classification for everything else."""

    def __init__(self, *, closed_memory: int = CLOSED_SESSION_MEMORY) -> None:
        self._live: dict[ContextTicket, V] = {}
        self._live_by_request: dict[str, set[ContextTicket]] = {}
        # ticket -> how it ended ("released", "quarantined", ...), oldest first.
        self._closed: collections.OrderedDict[ContextTicket, str] = collections.OrderedDict()
        # request id -> its remembered closed tickets (one per edge, a few at most:
        # a tuple costs a quarter of a set).
        self._closed_by_request: dict[str, tuple[ContextTicket, ...]] = {}
        self._closed_memory = closed_memory
        # What closed tickets share (their endpoints and digests), stored once:
        # a ticket decoded from a frame brings its own copies of them, which
        # made each remembered session cost ~1.1 KB instead of ~0.4 KB.
        self._shared: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._live

    def __iter__(self) -> Iterator[ContextTicket]:
        return iter(self._live)

    def items(self) -> Iterator[tuple[ContextTicket, V]]:
        return iter(self._live.items())

    def install(self, ticket: ContextTicket, session: V) -> None:
        """Install `session` under `ticket`; DuplicateSessionError if live, StaleError if closed."""
        if ticket in self._live:
            raise DuplicateSessionError(ticket)
        if ticket in self._closed:
            raise StaleError("session", ticket.edge, f"closed ({self._closed[ticket]})")
        self._live[ticket] = session
        self._live_by_request.setdefault(ticket.request_id, set()).add(ticket)

    def get(self, ticket: ContextTicket) -> V:
        """The session installed under exactly `ticket`, or StaleError / UnknownSessionError."""
        session = self._live.get(ticket)
        if session is not None:
            return session
        raise self.classify(ticket)

    def find(self, ticket: ContextTicket) -> V | None:
        """The session installed under exactly `ticket`, or None (no error built)."""
        return self._live.get(ticket)

    def classify(self, ticket: ContextTicket) -> ProtocolError:
        """The error a lookup of a non-installed `ticket` raises (returned, not raised)."""
        if ticket in self._live:
            raise ValueError("classify() is for tickets that are not installed")
        if ticket in self._closed:
            return StaleError("session", ticket.edge, f"closed ({self._closed[ticket]})")
        candidates = [
            *self._live_by_request.get(ticket.request_id, ()),
            *self._closed_by_request.get(ticket.request_id, ()),
        ]
        if not candidates:
            return UnknownSessionError(
                f"no session for request {ticket.request_id!r} edge {ticket.edge}"
            )
        # Prefer a candidate on the same edge so the error names the field
        # that really moved (an epoch, an attempt), not a sibling's rank.
        candidates.sort(key=lambda c: (c.edge != ticket.edge, c in self._closed))
        diff = stale_field(ticket, candidates[0])
        assert diff is not None  # equal tickets were handled above
        return StaleError(*diff)

    def close(self, ticket: ContextTicket, how: str) -> None:
        """Remove a live session, remembering how it ended (bounded)."""
        if ticket not in self._live:
            raise self.classify(ticket)
        del self._live[ticket]
        peers = self._live_by_request[ticket.request_id]
        peers.discard(ticket)
        if not peers:
            del self._live_by_request[ticket.request_id]
        self._remember(ticket, how)

    def refused(self, ticket: ContextTicket) -> None:
        """Remember a ticket that was never live here and was refused (a CTX
        rank's REJECT promised its GEN rank that nothing writes under it), so
        that a later copy of the same proposal is refused too (bounded, as
        closed sessions are). A live or already closed ticket is left alone."""
        if ticket not in self._live and ticket not in self._closed:
            self._remember(ticket, "refused")

    def _remember(self, ticket: ContextTicket, how: str) -> None:
        ticket = self._compact(ticket)
        self._closed[ticket] = how
        self._closed_by_request[ticket.request_id] = (*self._closed_by_request.get(ticket.request_id, ()), ticket)
        while len(self._closed) > self._closed_memory:
            old, _ = self._closed.popitem(last=False)
            group = tuple(t for t in self._closed_by_request[old.request_id] if t != old)
            if group:
                self._closed_by_request[old.request_id] = group
            else:
                del self._closed_by_request[old.request_id]

    def _compact(self, ticket: ContextTicket) -> ContextTicket:
        """An equal ticket whose endpoints and digests are the shared copies."""
        if len(self._shared) > _SHARED_PARTS:
            self._shared.clear()
        share = self._shared.setdefault
        return msgspec.structs.replace(
            ticket,
            ctx=share(ticket.ctx, ticket.ctx),
            gen=share(ticket.gen, ticket.gen),
            ctx_digest=share(ticket.ctx_digest, ticket.ctx_digest),
            gen_digest=share(ticket.gen_digest, ticket.gen_digest),
        )

    def closed_how(self, ticket: ContextTicket) -> str | None:
        """How a remembered closed session ended, or None."""
        return self._closed.get(ticket)
