"""A rank's configuration (`RankConfig`), what a rank knows of one peer
instance (`_Pair`), and what every module of the rank package shares: its
logger and `_loop_running`.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from kvhandoff.actors._faults import FaultPlan
from kvhandoff.protocol import (
    DEFAULT_QUARANTINE_LIMIT,
    Endpoint,
    Message,
    NegotiationOutcome,
    NotNegotiatedError,
    RankDescriptorV1,
    RankDescriptorV2,
    Role,
)
from kvhandoff.topology import KVLayout, TopologySpec, shard_map, topology_digest

#: What `RankConfig.frames` accepts (actors/_carrier.py resolves "auto" before a rank starts).
FRAME_CARRIERS = ("ray", "nixl", "stream")

log = logging.getLogger("kvhandoff.rank")


class DataPlane(msgspec.Struct, frozen=True, kw_only=True):
    """The data-plane settings a rank takes from its deployment: a base of
    `RankConfig` and of an engine's `EnginePlan`."""

    #: How the CTX moves an edge's chunks (docs/design.md "Staged data
    #: plane"): "direct" (one descriptor per piece, straight into the GEN
    #: blocks), "staged" (gather into a slot, one WRITE per slot, the GEN
    #: scatters it) or "auto" (staged for an edge whose pieces average under
    #: `staged_below` bytes, the measured crossover; 0: the device's default).
    #: Any mode but "direct" gives the rank a staging arena of
    #: `staging_window` slots of `staging_slot_bytes` per peer rank,
    #: registered once.
    data_mode: str = "auto"
    staging_window: int = 4
    staged_below: int = 0
    #: Bytes of one staging slot, which is the size of one staged chunk (a
    #: staged edge's chunks are planned at this size, a direct edge's at
    #: `chunk_bytes`). Every staged chunk costs a gather, a WRITE, a notice,
    #: a scatter and an ACK whatever its size, so on a GPU small slots leave
    #: the link idle (docs/benchmarks.md). 0: `staging_slot_default(device,
    #: chunk_bytes)`.
    staging_slot_bytes: int = 0
    #: "auto" stages an edge only from this many descriptors (pieces x
    #: blocks) on; 0: the device's measured default (`STAGED_MIN_DESCRIPTORS`).
    staged_min_descriptors: int = 0


class RankConfig(DataPlane, frozen=True, kw_only=True):
    """Everything one rank actor needs; the same for every incarnation but `epoch`."""

    deployment: str  # namespace of the named directory actor
    spec: TopologySpec  # our instance
    peer_spec: TopologySpec  # the other side's instance
    layout: KVLayout
    rank: int
    pool_blocks: int
    chunk_bytes: int = 1 << 20
    lease_timeout_s: float = 30.0
    poll_interval_s: float = 0.0005
    #: GEN, pull: how long a receive at the rank polls its own READs right
    #: after posting them, in the same turn of the event loop, before it
    #: leaves them to the poll loop (`GenRankCore.receive_at_once`). A READ
    #: of a request's KV in host memory ends in tens of µs; every turn of
    #: the loop it would otherwise take costs a wait for the GIL in an
    #: engine's process (docs/vllm.md). 0: never.
    read_spin_s: float = 0.0005
    #: The longest a frame or report that nothing waits for is held back to
    #: ride with the next one to the same actor (`RankCore._send`): READY and
    #: RECEIPT frames over Ray calls, a CTX rank's completion news. It delays
    #: no answer; a fleet's ranks, whose traffic spreads over many peers,
    #: make fewer calls per handoff with it (docs/journal/2026-12-05-benchmarks-history.md "Fleet scale").
    lazy_flush_s: float = 0.005
    #: The shortest gap between two of this rank's reports to its coordinator
    #: (0: none). News recorded sooner after a report waits out the gap and
    #: goes in one report with whatever else came meanwhile: a GEN rank whose
    #: batch of OPENs went to several CTX ranks hears their TERMINALs within
    #: a fraction of a millisecond of each other, each in its own turn of the
    #: event loop, and would report (and its coordinator run a round) once per
    #: peer. A rank that reported longer ago than the gap reports at once: a
    #: lone handoff waits for nothing. Off by default: on the 16-core GPU host
    #: a 1 ms gap lowered every fleet ratio (docs/design.md, "Messages").
    report_gap_s: float = 0.0
    device: str = "cpu"
    fault_plan: FaultPlan | None = None
    #: Outside the qualified scope (topology/_gate.py): a cancel never
    #: interrupts a decided transfer; it waits for it to finish, then releases.
    conservative: bool = False
    #: Synthetic prefill and byte verification (S2). Benchmarks of the protocol
    #: and data plane turn it off so they time the handoff, not the pattern.
    synthetic: bool = True
    #: CTX: post chunks from prepared NIXL descriptor lists (built once per edge
    #: and peer epoch) rather than descriptors built per chunk. Same bytes.
    prepared_descriptors: bool = True
    #: GEN: seconds decode-ready KV stays leased for its consumer (free()); past
    #: it the rank returns it (every edge COMPLETED: no writer is left).
    consume_timeout_s: float = 30.0
    #: Share of the pool quarantined at which this rank stops admitting and,
    #: once it holds nothing else, asks its coordinator for a restart (a new
    #: incarnation with a fresh, fully free pool). See docs/design.md.
    quarantine_limit: float = DEFAULT_QUARANTINE_LIMIT
    #: The protocol descriptor this rank advertises (None: `local_descriptor()`,
    #: everything this build speaks). Every rank of both instances negotiates
    #: from all of them (docs/design.md "Negotiation").
    descriptor: RankDescriptorV1 | RankDescriptorV2 | None = None
    #: How control frames travel to peer ranks: "ray" (a one-way actor call
    #: per peer and event-loop turn), "nixl" (a NIXL notification from our
    #: agent, drained by the poll loop, which then polls every
    #: `poll_interval_s` while a request is live; a peer whose agent we do
    #: not know yet gets the Ray call) or "stream" (a TCP connection per peer
    #: endpoint, read by the peer's event loop: actors/_stream.py; a peer it
    #: cannot reach gets the Ray call). docs/benchmarks.md measures them.
    frames: str = "stream"
    #: Whether the coordinator may replace this rank with a new incarnation
    #: (past the quarantine limit). A rank hosted by an engine's own actor is
    #: not ours to restart: it stops admitting instead, and its quarantined
    #: blocks come back only through a proof of quiescence (reclaim).
    restartable: bool = True
    #: Where this rank's KV lives (topology/_memory.py): "blocked", "paged",
    #: "paged_hnd" or "split"; `peer_memory_kind` is the other instance's
    #: (None: the same). The CTX plans its pieces from both.
    memory_kind: str = "blocked"
    peer_memory_kind: str | None = None
    #: The actor name of this instance's coordinator ("": the pair
    #: deployment's `<deployment>.coord.<role>`).
    coordinator: str = ""
    #: A fleet (docs/design.md "Fleet"): besides `peer_spec`, the rank pairs
    #: with every instance of the other role in the directory's instance
    #: table (read on `connect`, told by `peer_joined` / `peer_left`).
    fleet: bool = False
    #: CTX of a one-rank instance: admit a parent when its first OPEN
    #: arrives (`CtxRank.admit_at_open`) instead of in a round of our
    #: coordinator, and report the admission to it (docs/design.md
    #: "Admission at the OPEN"). The GEN coordinators then ask no peer
    #: admission (`Coordinator(peers_admit_at_open=True)`).
    admit_at_open: bool = False
    #: Advertise pull (`Capability.PULL`, docs/design.md "Pull"): between
    #: one-rank instances a CTX rank lends a published parent's blocks to
    #: its GEN rank, which READs them with no frame on the way; where the
    #: pair did not agree on it, or an edge would be staged, the handoff is
    #: pushed. Never with `data_mode="staged"`.
    pull: bool = False


class _Pair:
    """What a rank knows of one peer instance (docs/design.md "Fleet"): its
    spec, the pair's digests and shard map, the memory kind of its ranks, and
    the protocol the two instances negotiated (from the descriptors of every
    rank of both; redone when a peer incarnation re-registers)."""

    def __init__(self, ours: TopologySpec, peer: TopologySpec, layout: KVLayout, peer_kind: str) -> None:
        self.spec = peer
        self.instance = peer.instance_id
        ctx_spec, gen_spec = (ours, peer) if ours.role is Role.CTX else (peer, ours)
        self.ctx_digest = topology_digest(ctx_spec)
        self.gen_digest = topology_digest(gen_spec)
        self.peer_digest = topology_digest(peer)
        self.shards = shard_map(layout, ctx_spec.tp, gen_spec.tp)
        self.peer_kind = peer_kind
        self.negotiation: NegotiationOutcome = NotNegotiatedError(0, ours.tp + peer.tp)
        self.seq = [0, 0]  # [queries started, newest answer applied]
        self.negotiating = False  # an owned renegotiation runs (`_renegotiate`)
        self.again = False
        self.unsent: list[tuple[Endpoint, Message]] = []  # sends waiting for the answer
        self.left = False  # the instance left the fleet: nothing new with it


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
