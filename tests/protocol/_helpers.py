"""Steps the protocol tests share: a pair driven to a phase of one handoff."""

from __future__ import annotations

from collections.abc import Hashable

from kvhandoff.protocol import BlockPool, Open, ParentKey, decode_frame

from .harness import Pair, parent_key

P = parent_key(1)


def resident(pair: Pair, parent: ParentKey = P, *, blocks: int = 2, chunks: int = 2) -> Pair:
    """Admitted, prefilled and installed: the GEN ranks' OPENs still queued."""
    pair.admit(parent, blocks=blocks, chunks=chunks)
    pair.prefill(parent)
    pair.install(parent)
    return pair


def prepared(pair: Pair, parent: ParentKey = P, **size: int) -> Pair:
    """Resident, and every OPEN delivered: the CTX edges PREPARED."""
    resident(pair, parent, **size).deliver_all()
    return pair


def decided(pair: Pair, parent: ParentKey = P, **size: int) -> Pair:
    """Prepared, and decided by the one-rank CTX instance: READY queued, the first chunks posted."""
    prepared(pair, parent, **size).decide(parent)
    return pair


def posting(pair: Pair, parent: ParentKey = P, **size: int) -> Pair:
    """Decided, and the READY delivered: the GEN edges READY, chunks in flight."""
    decided(pair, parent, **size).deliver_all()
    return pair


def take_opens(pair: Pair) -> list[Open]:
    """The OPENs the GEN ranks queued, taken out of the queue (in GEN rank order)."""
    opens = []
    for env in list(pair.queue):
        message = decode_frame(env.frame)
        if isinstance(message, Open):
            pair.queue.remove(env)
            opens.append(message)
    return opens


def end_lease(pool: BlockPool, op: str, owner: Hashable) -> None:
    """End `owner`'s lease as `op` says: "release", "quarantine", or else reclaim its quarantine."""
    if op == "release":
        pool.release(owner)
    elif op == "quarantine":
        pool.quarantine(owner)
    else:
        pool.reclaim_quarantine(owner, proof="test")
