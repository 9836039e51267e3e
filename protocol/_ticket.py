"""Ticket identity: what names one transfer session (docs/design.md "Identity").

A `ContextTicket` names exactly one edge session of one parent attempt: the
request, both attempts, both endpoints (rank namespace plus the endpoint epoch
of the rank actor that owns it) and both topology digests. Request id alone
never authorizes anything; every registry lookup compares the whole ticket.

Tickets are frozen msgspec Structs so that they hash, compare and survive every
hop (Ray call, frame, NIXL notification, base64) unchanged. Every field is
bounded so the opaque state a peer can make us hold is bounded too.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hmac
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from ._errors import ProtocolError

__all__ = [
    "Role",
    "RankNamespace",
    "Endpoint",
    "ParentKey",
    "ContextTicket",
    "HandoffTicket",
    "Lend",
    "TicketError",
    "MAX_LEND_BLOCKS",
    "MAX_ID_LEN",
    "DIGEST_LEN",
    "MAX_TICKET_CHARS",
]

#: Longest request or instance id accepted anywhere (bytes of UTF-8).
MAX_ID_LEN = 128
#: Canonical topology digests are SHA-256 (topology/_digest.py).
DIGEST_LEN = 32

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN, pattern=r"^[A-Za-z0-9_.:\-]+$")]
U32 = Annotated[int, Meta(ge=0, lt=2**32)]
U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Rank = Annotated[int, Meta(ge=0, lt=4096)]
Digest = Annotated[bytes, Meta(min_length=DIGEST_LEN, max_length=DIGEST_LEN)]


class Role(str, enum.Enum):
    CTX = "ctx"  # prefill side: computes the KV and writes it
    GEN = "gen"  # decode side: owns the destination blocks


class _Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class RankNamespace(_Frozen, frozen=True):
    """`(instance id, role, rank)`: ranks are never compared across namespaces."""

    instance_id: Id
    role: Role
    rank: Rank


class Endpoint(_Frozen, frozen=True):
    """One rank actor incarnation: its namespace and its endpoint epoch.

    A rank actor gets a new epoch every time it starts, so a message addressed
    to a dead incarnation is stale, never merely late.
    """

    ns: RankNamespace
    epoch: U63


class ParentKey(_Frozen, frozen=True):
    """The parent (whole request attempt) that an edge session belongs to."""

    request_id: Id
    ctx_attempt: U32
    gen_attempt: U32


class _NamesParent:
    """Mixin of the structs that name one parent attempt by its three fields."""

    __slots__ = ()

    request_id: str
    ctx_attempt: int
    gen_attempt: int

    @property
    def parent(self) -> ParentKey:
        return ParentKey(
            request_id=self.request_id,
            ctx_attempt=self.ctx_attempt,
            gen_attempt=self.gen_attempt,
        )


class ContextTicket(_Frozen, _NamesParent, frozen=True):
    """Generation-safe identity of one edge session (one ctx rank → one gen rank)."""

    request_id: Id
    ctx_attempt: U32
    gen_attempt: U32
    ctx: Endpoint
    gen: Endpoint
    ctx_digest: Digest
    gen_digest: Digest

    @property
    def edge(self) -> tuple[int, int]:
        """`(ctx rank, gen rank)` of this session."""
        return (self.ctx.ns.rank, self.gen.ns.rank)


#: Most blocks a `Lend` names (a ticket carries them; a longer request is
#: pushed, not lent: 8,192 blocks are 131,072 tokens at 16 a block).
MAX_LEND_BLOCKS = 8192
#: Bytes of a lend's seal (`Lend.mac`: a truncated HMAC-SHA256).
LEND_MAC_BYTES = 16


def _lend_mac(key: bytes, parent: ParentKey, ctx_epoch: int, gen_epoch: int, seq: int, blocks: bytes) -> bytes:
    fields = (parent.request_id, parent.ctx_attempt, parent.gen_attempt, ctx_epoch, gen_epoch, seq, blocks)
    return hmac.digest(key, msgspec.msgpack.encode(fields), "sha256")[:LEND_MAC_BYTES]


#: Longest ticket string `HandoffTicket.decode` reads (checked before
#: decoding): a ticket's own fields in 1 KiB, and a lend's block ids.
MAX_TICKET_CHARS = 1024 + -(-4 * MAX_LEND_BLOCKS // 3) * 4
_TICKET_PREFIX = "kvh1."


class TicketError(ProtocolError, ValueError):
    """A ticket string that is not one `HandoffTicket.encode` wrote (too long,
    wrong prefix, not base64, not a ticket, a field out of its bounds)."""


class Lend(_Frozen, frozen=True):
    """A pull handoff's lend, as a ticket carries it to the reader: the CTX
    rank incarnation that lent its blocks (`ctx_epoch`), the GEN rank
    incarnation it lent them to (`gen_epoch`), its number for the lend
    (`seq`: a lend is read once), its block ids in order (`blocks`:
    little-endian uint32, `block_ids` reads them), and its seal (`mac`).

    A ticket crosses the caller's proxy, so the block ids it names are not
    to be believed on their word: a READ of ids a proxy garbled or forged
    would read another request's blocks. The lender seals the lend with a
    key of its incarnation (`seal`), which only its peers learn (from its
    directory entry); the reader checks the seal (`verify`), then the rest
    against what it knows (`GenRank.install_pull`), before it READs a byte."""

    ctx_epoch: U63
    gen_epoch: U63
    seq: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    blocks: Annotated[bytes, Meta(min_length=4, max_length=4 * MAX_LEND_BLOCKS)]
    mac: Annotated[bytes, Meta(min_length=LEND_MAC_BYTES, max_length=LEND_MAC_BYTES)]

    @classmethod
    def seal(
        cls, key: bytes, parent: ParentKey, *, ctx_epoch: int, gen_epoch: int, seq: int, blocks: bytes
    ) -> Lend:
        """The lend of `parent`'s `blocks`, sealed with the lender's `key`."""
        mac = _lend_mac(key, parent, ctx_epoch, gen_epoch, seq, blocks)
        return cls(ctx_epoch=ctx_epoch, gen_epoch=gen_epoch, seq=seq, blocks=blocks, mac=mac)

    def verify(self, key: bytes, parent: ParentKey) -> bool:
        """Whether this lend of `parent` was sealed with `key` as it is now."""
        want = _lend_mac(key, parent, self.ctx_epoch, self.gen_epoch, self.seq, self.blocks)
        return bool(key) and hmac.compare_digest(want, self.mac)

    def block_ids(self) -> list[int]:
        """The lent block ids, in order. `TicketError` if `blocks` is not
        whole uint32s."""
        if len(self.blocks) % 4:
            raise TicketError(f"a lend's block ids are uint32s: {len(self.blocks)} bytes")
        ids: list[int] = np.frombuffer(self.blocks, dtype="<u4").tolist()
        return ids

    @staticmethod
    def pack(ids: Sequence[int]) -> bytes:
        """`blocks` for block ids `ids` (each a uint32)."""
        return np.asarray(ids, dtype="<u4").tobytes()


class HandoffTicket(_Frozen, _NamesParent, frozen=True):
    """What a front end carries from the prefill server to the decode server.

    It names one published attempt of a request: the deployment, the parent
    key, the CTX instance and its topology digest (a ticket of another
    deployment or topology is refused where it is used), and the prompt's
    token count; a pull handoff's ticket also carries its `Lend`. Its string
    form (`encode`) is ``kvh1.`` and the URL-safe base64 of its msgpack
    encoding: it survives an HTTP header or a JSON body.
    `decode` is bounded and typed: it reads at most `MAX_TICKET_CHARS`
    characters and raises `TicketError` for anything else.
    """

    deployment: Id
    request_id: Id
    ctx_attempt: U32
    gen_attempt: U32
    ctx_instance: Id
    ctx_digest: Digest
    num_tokens: U32
    #: Pull: the CTX rank lent the blocks to one GEN rank, which READs them
    #: (docs/design.md "Pull"); None: pushed (the GEN rank OPENs).
    lend: Lend | None = None

    def encode(self) -> str:
        raw = msgspec.msgpack.encode(self)
        return _TICKET_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    @classmethod
    def decode(cls, text: object) -> HandoffTicket:
        """The ticket `text` names; `TicketError` (and nothing else) if it names none."""
        if not isinstance(text, str):
            raise TicketError(f"a ticket is a str, got {type(text).__name__}")
        if len(text) > MAX_TICKET_CHARS:
            raise TicketError(f"ticket of {len(text)} characters, at most {MAX_TICKET_CHARS}")
        if not text.startswith(_TICKET_PREFIX):
            raise TicketError(f"not a kvhandoff ticket (no {_TICKET_PREFIX!r} prefix)")
        body = text[len(_TICKET_PREFIX) :]
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TicketError(f"ticket is not URL-safe base64: {exc}") from None
        try:
            return _TICKET_DECODER.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TicketError(f"not a valid ticket: {exc}") from None


_TICKET_DECODER = msgspec.msgpack.Decoder(HandoffTicket)
