"""Hypothesis strategies for tickets and every control-plane message.

Shared by the protocol tests (and other layers' tests): every value these
strategies draw satisfies the wire schema, so ``decode_frame(encode_frame(m))``
must give ``m`` back. Public and stable:

- `ids()`, `digests()`, `rank_namespaces(role)`, `endpoints(role)`, `tickets()`
- `block_descriptors()`, `buffer_infos(max_blocks)`
- one strategy per kind: `opens()`, `readies()`, `cancels()`, `terminals()`,
  `receipts()`, `rejects()`, `descriptors_v1()`, `descriptors_v2()`
- `worst_case_open(blocks)`: the largest legal OPEN, every field at its bound
  (the reference cost for decode-time checks).
- `descriptors()` (either descriptor kind), `session_messages()`, and
  `messages(version=None)`: any message, or only the kinds `version` allows.

Ticket strategies take optional fixed parts so stateful tests can build a
family of related tickets (same parent, different edges or epochs).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import strategies as st

from kvhandoff.protocol import (
    DIGEST_LEN,
    MAX_AGENT_NAME_LEN,
    MAX_BLOCKS_PER_OPEN,
    MAX_DETAIL_LEN,
    MAX_ID_LEN,
    BlockDescriptor,
    BufferInfo,
    Cancel,
    CancelReason,
    ContextTicket,
    Endpoint,
    MemoryKind,
    Message,
    Open,
    RankDescriptorV1,
    RankDescriptorV2,
    RankNamespace,
    Ready,
    Receipt,
    Reject,
    RejectReason,
    Role,
    Terminal,
    TerminalKind,
    allowed_kinds,
)

__all__ = [
    "worst_case_open",
    "ID_ALPHABET",
    "u32s",
    "u63s",
    "ids",
    "digests",
    "rank_namespaces",
    "endpoints",
    "tickets",
    "block_descriptors",
    "buffer_infos",
    "opens",
    "readies",
    "cancels",
    "terminals",
    "receipts",
    "rejects",
    "descriptors_v1",
    "descriptors_v2",
    "descriptors",
    "session_messages",
    "messages",
    "MESSAGE_STRATEGIES",
]

#: Characters a request/instance id may use (the `Id` pattern of _ticket.py).
ID_ALPHABET = string.ascii_letters + string.digits + "_.:-"

u32s = st.integers(min_value=0, max_value=2**32 - 1)
u63s = st.integers(min_value=0, max_value=2**63 - 1)
_ranks = st.integers(min_value=0, max_value=4095)
_details = st.text(max_size=MAX_DETAIL_LEN)
_M = TypeVar("_M")


def ids(max_size: int = MAX_ID_LEN) -> st.SearchStrategy[str]:
    """Request / instance ids: 1..`max_size` characters of `ID_ALPHABET`."""
    return st.text(alphabet=ID_ALPHABET, min_size=1, max_size=max_size)


def digests() -> st.SearchStrategy[bytes]:
    """Canonical topology digests (32 bytes)."""
    return st.binary(min_size=DIGEST_LEN, max_size=DIGEST_LEN)


def rank_namespaces(
    role: Role | None = None, *, instance_id: str | None = None
) -> st.SearchStrategy[RankNamespace]:
    """Rank namespaces; `role`/`instance_id` fixed when given."""
    return st.builds(
        RankNamespace,
        instance_id=ids() if instance_id is None else st.just(instance_id),
        role=st.sampled_from(Role) if role is None else st.just(role),
        rank=_ranks,
    )


def endpoints(role: Role | None = None) -> st.SearchStrategy[Endpoint]:
    """Endpoints (namespace + epoch) of `role`, or of either role."""
    return st.builds(Endpoint, ns=rank_namespaces(role), epoch=u63s)


def tickets(
    *,
    request_id: str | None = None,
    ctx: Endpoint | None = None,
    gen: Endpoint | None = None,
) -> st.SearchStrategy[ContextTicket]:
    """Valid tickets: the ctx endpoint has role CTX, the gen endpoint role GEN.

    Pass `request_id`, `ctx` or `gen` to fix that part.
    """
    return st.builds(
        ContextTicket,
        request_id=ids() if request_id is None else st.just(request_id),
        ctx_attempt=u32s,
        gen_attempt=u32s,
        ctx=endpoints(Role.CTX) if ctx is None else st.just(ctx),
        gen=endpoints(Role.GEN) if gen is None else st.just(gen),
        ctx_digest=digests(),
        gen_digest=digests(),
    )


def block_descriptors() -> st.SearchStrategy[BlockDescriptor]:
    """One (block, generation, addr, length) destination descriptor."""
    return st.builds(BlockDescriptor, block=u32s, generation=u63s, addr=u63s, length=u32s)


def buffer_infos(max_blocks: int = 8) -> st.SearchStrategy[BufferInfo]:
    """GEN buffer info with 1..`max_blocks` blocks (kept small for speed)."""
    return st.builds(
        BufferInfo,
        agent_name=st.text(min_size=1, max_size=MAX_AGENT_NAME_LEN),
        endpoint_epoch=u63s,
        memory=st.sampled_from(MemoryKind),
        device=st.integers(min_value=0, max_value=1023),
        blocks=st.lists(block_descriptors(), min_size=1, max_size=max_blocks),
    )


def _with_ticket(
    kind: Callable[..., _M], ticket: st.SearchStrategy[ContextTicket] | None, **fields: st.SearchStrategy[Any]
) -> st.SearchStrategy[_M]:
    """`st.builds(kind, ...)` with its ticket from `ticket`, or any ticket when None."""
    return st.builds(kind, ticket=tickets() if ticket is None else ticket, **fields)


def opens(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Open]:
    return _with_ticket(Open, ticket, buffer=buffer_infos(), num_tokens=u32s)


def readies(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Ready]:
    return _with_ticket(Ready, ticket, round_no=u63s)


def cancels(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Cancel]:
    return _with_ticket(Cancel, ticket, reason=st.sampled_from(CancelReason), detail=_details)


def terminals(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Terminal]:
    return _with_ticket(Terminal, ticket, evidence=st.sampled_from(TerminalKind), bytes_done=u63s)


def receipts(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Receipt]:
    return _with_ticket(Receipt, ticket, bytes_received=u63s)


def rejects(ticket: st.SearchStrategy[ContextTicket] | None = None) -> st.SearchStrategy[Reject]:
    return _with_ticket(Reject, ticket, reason=st.sampled_from(RejectReason), detail=_details)


def descriptors_v1(
    versions: st.SearchStrategy[int] | None = None,
) -> st.SearchStrategy[RankDescriptorV1]:
    """v1 descriptors; `versions` draws the one version (default 1..255)."""
    return st.builds(
        RankDescriptorV1,
        version=st.integers(min_value=1, max_value=255) if versions is None else versions,
        capabilities=u32s,
    )


def descriptors_v2(
    versions: st.SearchStrategy[int] | None = None,
    abis: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[RankDescriptorV2]:
    """v2 descriptors: 1..16 versions drawn from `versions`, an ABI from `abis`."""
    return st.builds(
        RankDescriptorV2,
        versions=st.lists(
            st.integers(min_value=1, max_value=255) if versions is None else versions,
            min_size=1,
            max_size=16,
        ),
        capabilities=u32s,
        abi=st.text(min_size=1, max_size=64) if abis is None else abis,
    )


def descriptors(
    versions: st.SearchStrategy[int] | None = None,
    abis: st.SearchStrategy[str] | None = None,
) -> st.SearchStrategy[RankDescriptorV1 | RankDescriptorV2]:
    """Either descriptor kind (v1 descriptors always imply ABI "msgpack-v1")."""
    return st.one_of(descriptors_v1(versions), descriptors_v2(versions, abis))


#: One strategy per message type: the `Message` union, member by member.
MESSAGE_STRATEGIES: dict[type, st.SearchStrategy[Message]] = {
    Open: opens(),
    Ready: readies(),
    Cancel: cancels(),
    Terminal: terminals(),
    Receipt: receipts(),
    Reject: rejects(),
    RankDescriptorV1: descriptors_v1(),
    RankDescriptorV2: descriptors_v2(),
}


def session_messages() -> st.SearchStrategy[Message]:
    """Any message that names an edge session by its ticket."""
    return st.one_of(opens(), readies(), cancels(), terminals(), receipts(), rejects())


def messages(version: int | None = None) -> st.SearchStrategy[Message]:
    """Any message; with `version`, only the kinds that version allows."""
    if version is None:
        return st.one_of(*MESSAGE_STRATEGIES.values())
    allowed = allowed_kinds(version)
    return st.one_of(
        *(
            strategy
            for msg_type, strategy in MESSAGE_STRATEGIES.items()
            if msg_type.__struct_config__.tag in allowed  # type: ignore[attr-defined]
        )
    )


def worst_case_open(blocks: int = MAX_BLOCKS_PER_OPEN) -> Open:
    # Every variable-length field at its bound and every int at its widest encoding.
    big_id = "x" * MAX_ID_LEN
    top = 2**63 - 1

    def endpoint(role: Role) -> Endpoint:
        return Endpoint(ns=RankNamespace(instance_id=big_id, role=role, rank=4095), epoch=top)

    ticket = ContextTicket(
        request_id=big_id,
        ctx_attempt=2**32 - 1,
        gen_attempt=2**32 - 1,
        ctx=endpoint(Role.CTX),
        gen=endpoint(Role.GEN),
        ctx_digest=b"\xff" * 32,
        gen_digest=b"\xff" * 32,
    )
    return Open(
        ticket=ticket,
        buffer=BufferInfo(
            agent_name="\U0001f600" * MAX_AGENT_NAME_LEN,  # 4 UTF-8 bytes each
            endpoint_epoch=top,
            memory=MemoryKind.VRAM,
            device=1023,
            blocks=[BlockDescriptor(block=2**32 - 1, generation=top, addr=top, length=2**32 - 1)]
            * blocks,
        ),
        num_tokens=2**32 - 1,
    )
