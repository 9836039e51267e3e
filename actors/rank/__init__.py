"""The rank actors: one rank of one instance as a Ray async actor, one class per role.

Theory of operation (docs/design.md "Lifecycle", "Agreement rounds")
---------------------------------------------------------------------------
A rank actor is an I/O shell around one sans-IO protocol object (`CtxRank` or
`GenRank` from `kvhandoff.protocol`) and its `BlockPool`. It makes no protocol
decision itself: every entry point decodes or gathers the event, hands it to
the protocol object in an await-free critical section, and then *performs* the
returned actions (`_perform`): send a frame to a peer rank actor, post a NIXL
WRITE chunk, poison released GEN blocks, feed intents to the next round.

The shell is split by role, with no role branch in it:

- `RankCore`, the common base: identity and directory registration, the
  negotiation, peers and their notices, frames (`receive_frames` and
  `receive_frame` decode, gate and dispatch; `_send`/`_flush` group outgoing
  frames per peer and turn), reports to the coordinator (`_nudge`,
  `_push_report`), the rounds through a `RoundMember` (`_vote`, `_apply`), the
  poll loop's skeleton (`expire` ticks), outcomes (`wait`), `stats`, and
  `_perform` for the actions both roles produce. What differs by role goes
  through hooks the base calls (`_make_side`, `_admit`, `_admitted`,
  `_decided`, `_receive`/`_accept`, `_perform_role`, `_releasing`,
  `_bytes_ok`, `_poll_chunks`, ...), never through a test of the role;
- `CtxRankCore`: admission with a lease deadline, prefill, OPEN checks and
  chunk plans, voting prepared, posting a decided parent's chunks and polling
  them, and the conservative path (the bench's raw baselines run on it from
  outside, kvhandoff.cli._baselines: no rank actor has a method for them);
- `GenRankCore`: admission with a deadline, install and OPEN on admission
  (`_open`, or `_open_later` once every CTX endpoint is known), byte
  verification (S2) before a completion is voted, decode-ready KV returned on
  `free` (or at once when the submission asked), released blocks poisoned.

`CtxRankActor` and `GenRankActor` are those two as Ray actors;
`rank_actor_class(role)` picks one, and `RankActor.options(...).remote(config,
epoch)` picks by `config.spec.role` (the deployment's rank factory).

A rank holds:
- a `KVBuffer` (one registered region: the rank's block pool memory) and a
  `NixlTransport` whose agent name is unique per endpoint epoch; its buffer
  geometry goes into the directory, so that a CTX rank can check every OPEN
  (its agent is the sender's own, each block descriptor is a whole block of
  that agent's registered buffer) and post its chunks by index from NIXL
  descriptor lists prepared once per edge and peer epoch;
- a `RoundMember` through which its coordinator runs the agreement rounds
  (`round_identity/join/vote/apply` are exposed as actor methods);
- a poll task (owned, cancelled on shutdown) that polls posted chunks (CTX) to
  DONE or ERR and ticks `expire(now)`; it only reports results to the protocol
  object and records intents, never frees memory on its own;
- `peer_restarted`, called by the directory when a peer incarnation is known
  dead: the protocol ends the sessions with it (unproven DMA → UNKNOWN →
  quarantine) instead of waiting for their transfer timeout;
- the protocol negotiation (docs/design.md "Negotiation"): the rank publishes
  its descriptor (`RankConfig.descriptor`, default `local_descriptor()`) with
  its directory entry and, on `connect` and after a peer restart, gathers the
  descriptors of every rank of both instances and lets `agree` decide. Until
  an agreement exists it admits nothing and refuses every frame but an OPEN
  (answered REJECT(NEGOTIATION)) and a REJECT; with one, every frame is
  written in and read against the agreed version, and the CTX runs the active
  cancel protocol only if the agreed capabilities carry it.

Lock and await ordering: the actor runs on one event loop; every handler
mutates protocol state only between awaits (see actors/_member.py and
docs/rounds.md). Frames to peers are submitted with `.remote()` synchronously
inside `_perform`, so frames from this rank to one peer are submitted in the
order the protocol produced them (READY before TERMINAL); the resulting refs are
awaited by owned tasks only to log delivery failures.

Round channels used (protocol/_rounds.py): admissions (every rank leases),
`prepared` → `decided` (CTX: every edge of the parent prepared on every rank:
publish READY and post), completions (intersection: success), cancels and
failures (union). A parent that was cancelled or failed is released per rank
once every local edge has terminal evidence proving quiescence (the evidence
is the proof; no further round is needed for that rank's own blocks).

The package, one module per concern (`RankCore` is mixed from the first
five):

- `_config`: `RankConfig`, and what a rank knows of one peer instance (`_Pair`);
- `_state`: the state every rank holds (`RankCore(config, epoch)` builds it)
  and the role's hooks;
- `_peers`: identity and directory, the negotiation, peers and the fleet,
  the directory's notices;
- `_control`: reports to the coordinator, the rounds' vote and apply,
  control frames in and the protocol's actions out (`_perform`, `_send`);
- `_poll`: the synthetic pattern, the poll loop, outcomes, stats, metrics;
- `_core`: `RankCore`, those mixed together, with its round and lifecycle
  actor methods;
- `_ctx`, `_gen`: `CtxRankCore`, `GenRankCore`;
- `_host`: `EndpointHost`, `endpoint_actor` and the rank actor classes.

`agent_name` lives in actors/_names.py (re-exported here): the staged data
plane (actors/_stager.py) needs it, and it reaches a rank core only through
the protocols it declares (`WriterHost`, `ReaderHost`), never through this
package.
"""

from __future__ import annotations

from kvhandoff.actors._names import agent_name
from kvhandoff.actors.rank._config import DataPlane, RankConfig
from kvhandoff.actors.rank._core import RankCore
from kvhandoff.actors.rank._ctx import CtxRankCore
from kvhandoff.actors.rank._gen import GenRankCore
from kvhandoff.actors.rank._host import (
    ENDPOINT_GROUP,
    ENDPOINT_METHODS,
    CtxRankActor,
    EndpointHost,
    GenRankActor,
    RankActor,
    endpoint_actor,
    endpoint_loop,
    rank_actor_class,
)

__all__ = [
    "RankConfig",
    "DataPlane",
    "RankActor",
    "RankCore",
    "CtxRankCore",
    "GenRankCore",
    "CtxRankActor",
    "GenRankActor",
    "rank_actor_class",
    "agent_name",
    "EndpointHost",
    "ENDPOINT_METHODS",
    "ENDPOINT_GROUP",
    "endpoint_actor",
    "endpoint_loop",
]
