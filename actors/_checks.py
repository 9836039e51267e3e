"""Every client-side check of a caller's input, in one place.

`Deployment`, `Fleet`, `EngineDeployment` and `EngineFleet` refuse what can
never succeed here, before any actor call: a request id, a token count, an
engine's block ids and a timeout (`InvalidRequest`), and the few launch
arguments that are not a `LaunchConfig` field (`InvalidConfig`; the config's
own fields are checked by actors/_config.py). Where the wire type has a rule
(protocol/_ticket.py `Id`, the admission message's bounds), the check is
that rule, not a copy of it. Nothing here changes any state.

The coordinator checks what reaches it as an actor call the same way
(`check_admission`), raising `RoundError`: its callers are clients and
engines in other processes, whose own checks it cannot trust.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from kvhandoff.actors._carrier import CARRIERS
from kvhandoff.actors._errors import InvalidConfig, InvalidRequest, StaleTicket
from kvhandoff.protocol import (
    MAX_REQUEST_BLOCKS,
    AdmissionRequest,
    HandoffTicket,
    ParentKey,
    RoundError,
    TicketError,
)
from kvhandoff.topology import KVLayout, blocks_for_tokens

__all__ = [
    "short",
    "parent_key",
    "check_request_id",
    "fresh_parent",
    "check_tokens",
    "check_blocks",
    "check_timeout",
    "check_int",
    "check_seconds",
    "check_frames",
    "own_ticket",
    "check_admission",
]

#: A valid parent, to check a token count against the admission message's type.
_ANY_PARENT = {"request_id": "r", "ctx_attempt": 0, "gen_attempt": 0}


def short(value: Any) -> str:
    """`repr(value)`, cut short: a 4 KiB request id must not make a 4 KiB error."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def parent_key(request_id: Any, attempt: int = 0) -> ParentKey:
    """The parent of `request_id`'s `attempt` (both sides), or `InvalidRequest`."""
    try:
        return msgspec.convert({"request_id": request_id, "ctx_attempt": attempt, "gen_attempt": attempt}, ParentKey)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request id {short(request_id)}: {exc}") from None


def check_request_id(request_id: Any) -> None:
    parent_key(request_id)


def fresh_parent(request_id: Any) -> ParentKey:
    """A parent of `request_id` with a fresh attempt, drawn at random: front
    ends in several processes publish without a shared counter, and two
    attempts of one request id collide with probability 2**-31 (a collision
    is refused by the pools: attempts are never reused on a rank)."""
    return parent_key(request_id, secrets.randbits(31) + 1)


def check_tokens(num_tokens: Any, layout: KVLayout, pool_blocks: int | None = None) -> int:
    """A token count one request may carry: a positive int within the
    admission message's bound, needing at most `MAX_REQUEST_BLOCKS` blocks
    (what one OPEN carries) and, given `pool_blocks`, no more than one rank's
    pool. Returns the blocks it needs per rank."""
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise InvalidRequest(f"num_tokens must be an int >= 1, got {short(num_tokens)}")
    try:  # the round message's own bound on it
        msgspec.convert({"parent": _ANY_PARENT, "num_tokens": num_tokens}, AdmissionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"num_tokens={num_tokens}: {exc}") from None
    need = blocks_for_tokens(layout, num_tokens)
    if need > MAX_REQUEST_BLOCKS:
        raise InvalidRequest(
            f"num_tokens={num_tokens} needs {need} blocks per rank; one request may lease at most "
            f"{MAX_REQUEST_BLOCKS} (what one OPEN carries)"
        )
    if pool_blocks is not None and need > pool_blocks:
        raise InvalidRequest(f"num_tokens={num_tokens} needs {need} blocks; a rank's pool has only {pool_blocks}")
    return need


def check_blocks(num_tokens: Any, blocks: Any, layout: KVLayout) -> tuple[int, ...]:
    """An engine's block ids for `num_tokens`: exactly as many as they need,
    each a U32, none twice."""
    need = check_tokens(num_tokens, layout)
    try:
        ids = tuple(blocks)
    except TypeError:
        raise InvalidRequest(f"blocks must be a sequence of block ids, got {short(blocks)}") from None
    if len(ids) != need:
        raise InvalidRequest(f"{num_tokens} tokens need {need} blocks, got {len(ids)}")
    if any(not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < 2**32 for b in ids):
        raise InvalidRequest(f"block ids must be ints in [0, 2**32), got {short(ids)}")
    if len(set(ids)) != len(ids):
        raise InvalidRequest("a block id is named twice")
    return ids


def check_timeout(timeout: Any) -> float:
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise InvalidRequest(f"timeout must be a positive number of seconds, got {short(timeout)}")
    return float(timeout)


def check_int(field: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidConfig(f"{field} must be an int >= {least}, got {short(value)}")


def check_seconds(**values: Any) -> None:
    """Every value a positive number of seconds, or `InvalidConfig` naming the first that is not."""
    for field, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise InvalidConfig(f"{field} must be a positive number of seconds, got {short(value)}")


def check_frames(control_frames: Any) -> None:
    if control_frames not in CARRIERS:
        raise InvalidConfig(f"control_frames must be one of {list(CARRIERS)}, got {short(control_frames)}")


def own_ticket(ticket: Any, deployment: str) -> HandoffTicket:
    """``ticket`` (a `HandoffTicket` or its string form) if it is one of
    ``deployment``'s: `TicketError` for anything that is not a ticket,
    `StaleTicket` for another deployment's."""
    if isinstance(ticket, str):
        ticket = HandoffTicket.decode(ticket)
    if not isinstance(ticket, HandoffTicket):
        raise TicketError(f"a ticket is a HandoffTicket or its string form, got {type(ticket).__name__}")
    if ticket.deployment != deployment:
        raise StaleTicket(f"ticket of deployment {ticket.deployment!r}, this is {deployment!r}")
    return ticket


def check_admission(parent: Any, num_tokens: Any, blocks: Any) -> tuple[int, ...]:
    """What no rank could vote on, refused before it reaches a round (the
    coordinator's boundary: `RoundError`): the parent re-validated against
    its wire schema (a Struct built in Python is not), the size a positive
    int (bool is not) within the admission message's bound, and an engine's
    block ids within that message's bounds, none twice (the ranks check them
    against their pools). Returns the block ids."""
    if type(num_tokens) is not int or not 0 < num_tokens < 2**32:
        raise RoundError(f"num_tokens must be a positive int below 2**32, got {short(num_tokens)}")
    try:
        msgspec.convert(msgspec.to_builtins(parent), ParentKey)
    except (msgspec.ValidationError, TypeError) as exc:
        raise RoundError(f"invalid parent {short(parent)}: {exc}") from None
    try:
        request = msgspec.convert({"parent": _ANY_PARENT, "num_tokens": 0, "blocks": list(blocks)}, AdmissionRequest)
    except (msgspec.ValidationError, TypeError) as exc:
        raise RoundError(f"invalid block ids: {exc}") from None
    if len(set(request.blocks)) != len(request.blocks):
        raise RoundError("a block id is named twice")
    return request.blocks
