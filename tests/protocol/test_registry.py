"""Default-deny registry: exact tickets only; stale vs unknown; bounded closed record."""

from __future__ import annotations

import msgspec
import pytest

from kvhandoff.protocol import (
    BlockDescriptor,
    BlockPool,
    DuplicateSessionError,
    SessionRegistry,
    StaleError,
    UnknownSessionError,
    check_descriptor,
)

from .harness import ctx_endpoint, gen_endpoint, make_ticket, parent_key

T = make_ticket(parent_key(1), ctx_endpoint(), gen_endpoint())
r = msgspec.structs.replace


def test_exact_ticket_only() -> None:
    reg: SessionRegistry[str] = SessionRegistry()
    reg.install(T, "s")
    assert reg.get(T) == "s" and T in reg and len(reg) == 1
    with pytest.raises(DuplicateSessionError):
        reg.install(T, "again")


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (r(T, ctx_attempt=1), "ctx attempt"),
        (r(T, gen_attempt=1), "gen attempt"),
        (r(T, ctx=ctx_endpoint(epoch=2)), "ctx epoch"),
        (r(T, gen=gen_endpoint(epoch=2)), "gen epoch"),
        (
            r(T, gen=r(gen_endpoint(), ns=r(gen_endpoint().ns, instance_id="other"))),
            "gen namespace",
        ),
        (r(T, ctx_digest=bytes(32)), "ctx topology digest"),
        (r(T, gen_digest=bytes(32)), "gen topology digest"),
    ],
)
def test_same_request_other_identity_is_stale(bad: object, field: str) -> None:
    reg: SessionRegistry[str] = SessionRegistry()
    reg.install(T, "s")
    with pytest.raises(StaleError) as info:
        reg.get(bad)  # type: ignore[arg-type]
    assert info.value.what == field


def test_never_seen_is_unknown_and_closed_is_stale() -> None:
    reg: SessionRegistry[str] = SessionRegistry(closed_memory=2)
    with pytest.raises(UnknownSessionError):
        reg.get(T)
    reg.install(T, "s")
    reg.close(T, "released")
    with pytest.raises(StaleError) as info:
        reg.get(T)
    assert "released" in str(info.value) and reg.closed_how(T) == "released"
    with pytest.raises(StaleError):
        reg.install(T, "reuse")  # a closed session is never reinstalled
    # The record is bounded: old sessions are forgotten (then unknown).
    for n in range(2, 5):
        t = make_ticket(parent_key(n), ctx_endpoint(), gen_endpoint())
        reg.install(t, "x")
        reg.close(t, "released")
    with pytest.raises(UnknownSessionError):
        reg.get(T)


def test_descriptor_generation_must_be_current() -> None:
    pool = BlockPool(2)
    (ref,) = pool.lease("a", 1)
    assert check_descriptor(pool, BlockDescriptor(ref.block, ref.generation, 0, 1)) == ref
    with pytest.raises(StaleError):
        check_descriptor(pool, BlockDescriptor(ref.block, ref.generation - 1, 0, 1))
    with pytest.raises(StaleError):
        check_descriptor(pool, BlockDescriptor(99, 1, 0, 1))
    pool.release("a")
    with pytest.raises(StaleError):
        check_descriptor(pool, BlockDescriptor(ref.block, ref.generation, 0, 1))


def test_a_remembered_closed_session_costs_a_few_hundred_bytes() -> None:
    """Issue 22 (h): what a rank remembers of a closed session is its ticket,
    and tickets decoded from frames each bring their own endpoints and
    digests; the registry keeps one shared copy of those, so a full memory
    of closed sessions costs ~0.35 KB each (it cost ~1.1 KB: 9 MiB per
    registry at the default bound). Measured as a full turnover of the
    memory, so only what it holds at steady state counts."""
    import gc
    import tracemalloc

    def decoded(i: int) -> object:
        t = r(T, request_id=f"soak-{i:08d}-abcdefgh")
        return msgspec.msgpack.decode(msgspec.msgpack.encode(t), type=type(T))

    n = 2048
    reg: SessionRegistry[int] = SessionRegistry(closed_memory=n)
    for i in range(n):
        t = decoded(i)
        reg.install(t, i)  # type: ignore[arg-type]
        reg.close(t, "released")  # type: ignore[arg-type]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n, 2 * n):
            t = decoded(i)
            reg.install(t, i)  # type: ignore[arg-type]
            reg.close(t, "released")  # type: ignore[arg-type]
        del t
        gc.collect()
        per_session = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_session <= 512, per_session
    # Still exact: the remembered ticket is classified as closed, not unknown.
    with pytest.raises(StaleError, match="closed"):
        reg.get(decoded(2 * n - 1))  # type: ignore[arg-type]
