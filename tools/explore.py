"""`kvhandoff explore`: every interleaving of a small handoff world, within bounds.

The explorer drives the real protocol objects (`CtxRank`, `GenRank`, their
block pools and session registries) through the pair model
(`tools/pair_model.py`: a CTX instance of one or two ranks and a GEN
instance of one or two, wired by the shard map; encoded frames on the wire,
a model of the DMA chunks in flight, the agreement rounds as the
coordinators' real round leaders decide them). It enumerates, breadth
first, every sequence of events a world can take:

- per request: admission (both instances lease), each CTX rank's prefill,
  each GEN rank's install (its OPENs), the decision once every edge is
  prepared (a one-rank CTX instance decides alone; with two CTX ranks the
  CTX round decides, in `rounds`), the consumer's free once decode-ready;
- the wire: any queued frame delivered next (reordering), or lost, or
  delivered twice;
- the data plane: any posted chunk ends DONE or ERR, or fails part-way (an
  ERR whose other descriptors may still land);
- a cancel of any live request, on any rank, at any point;
- a round (cancels, NOT_STARTED verdicts, completions);
- time passing every deadline (the timers fire);
- a rank death: a GEN or CTX rank restarts with a new epoch, and the
  directory later confirms the old incarnation dead.

Loss, duplication, ERRs, partial failures, cancels, timer firings and deaths
each have a budget per world, so the space is finite. States are hashed (a
canonical pickle of the whole world: the frames in flight as a sorted
multiset, so two orders of sending are one state), and breadth-first order
makes the first trace found to any state a shortest one.

In every state it checks S1 (no block a chunk may still touch is free or
re-leased), S3 (a refused frame changes nothing; a rank refuses only with a
`ProtocolError`), S4 and ownership (each block in exactly one state; what
the pools own is what the live requests own). In every quiescent state (no
frame and no chunk in flight) it settles a copy of the world (rounds, frees,
every timer) and checks L1 (every request ended) and L2 (no lease left:
free + quarantined = pool, and a quarantine only where a write may still
land). A violation is reported with its shortest trace, as readable steps.

The bounds are named worlds (`CONFIGS`): `default` is CI's (pairs of fault
kinds on TP 1 -> 1, 1 -> 2, 2 -> 1 and 2 -> 2, each world explored to
completion, ~245,000 states in about two and a half minutes on a 2-core
box), `large` runs on demand.
``--planted tests/mutation/mutants.toml`` runs the explorer once per
protocol mutant listed in `PLANTED` (in a scratch copy of the source, as
tests/mutation/run.py does) and counts those it finds.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from typing import Any

from kvhandoff.protocol import (
    Cancel,
    CancelReason,
    CtxRank,
    GenRank,
    Open,
    ParentKey,
    ParentState,
    Ready,
    Receipt,
    Reject,
    Role,
    Terminal,
    decode_frame,
)
from kvhandoff.tools._flags import add_explore_arguments
from kvhandoff.tools.pair_model import Envelope, Pair, parent_key, protocol_call

__all__ = ["CONFIGS", "PLANTED", "Config", "Result", "Violation", "explore", "main"]


@dataclasses.dataclass(frozen=True)
class Config:
    """The bounds of one exploration."""

    name: str
    gen_ranks: int = 1  # GEN instance TP
    ctx_ranks: int = 1  # CTX instance TP (several: its round decides a prepared parent)
    #: CTX instances (a fleet's): request n goes to instance (n - 1) mod this;
    #: the one GEN instance pairs with each.
    ctx_instances: int = 1
    requests: int = 1
    chunks: int = 2  # chunks per edge
    window: int = 1  # chunks a CTX edge keeps posted at once
    cancels: int = 1  # cancels, any rank, any request, any moment
    drops: int = 0  # frames lost (see the "lossy" bounds)
    dups: int = 1  # frames delivered twice
    reorders: int = 1  # frames delivered before an earlier one of their channel
    errs: int = 1  # chunks that end ERR
    partials: int = 0  # chunks that fail part-way (an ERR with writes still landing)
    expiries: int = 1  # times every deadline passes
    restarts: int = 1  # rank deaths (GEN or CTX), each with a new epoch
    #: Blocks in each CTX / GEN rank's pool (0: one per request). Fewer than
    #: the requests: an instance refuses an admission, and the pairing
    #: vetoes it on the peer or undoes the peer's.
    ctx_blocks: int = 0
    gen_blocks: int = 0
    #: 1: the rounds also apply the topology-wide NOT_STARTED verdict. 0 (the
    #: runtime): each rank releases on its own evidence, the cancel decided.
    verdict: int = 0
    #: 1: the direct path (one-rank CTX instances): no CTX round admits; the
    #: CTX rank admits at the OPEN, or refuses it with a REJECT.
    direct: int = 0
    #: 1: pull (the CTX ranks lend their blocks, the GEN ranks READ them).
    pull: int = 0
    max_states: int = 1_000_000
    max_depth: int = 80

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Named bounds. `default` is CI's (a bounded run on a 2-core box); `large`
#: runs on demand. The topology is a CTX instance of `ctx_ranks` and a GEN
#: instance of `gen_ranks`, wired by the shard map's edges.
def _world(name: str, **bounds: int) -> Config:
    """A world with only the faults named (a budget is at most: a world
    holds every path with fewer of them too)."""
    none = dict(cancels=0, drops=0, dups=0, reorders=0, errs=0, partials=0, expiries=0, restarts=0)
    return Config(name, **{**none, **bounds})


#: The default worlds: pairs of fault kinds (restart, cancel, deadline,
#: duplicate, reordering, ERR and partial failure) on TP 1 -> 1 handoffs of
#: two chunks, on TP 1 -> 2, TP 2 -> 1 and TP 2 -> 2 (where a CTX round
#: decides what every CTX rank reported prepared), and two concurrent
#: handoffs. Each runs to completion (every interleaving, to the end):
#: ~245,000 states, about two and a half minutes on a 2-core box (two worlds at
#: a time).
_DEFAULT = [  # largest first: two workers finish about together
    _world("ctx2-gen1-cancel-deadline", ctx_ranks=2, chunks=1, cancels=1, expiries=1),
    _world("tp2-restart-reorder", gen_ranks=2, chunks=1, restarts=1, reorders=1),
    _world("tp2-err-dup", gen_ranks=2, chunks=1, errs=1, partials=1, dups=1),
    _world("ctx2-gen1-restart-err", ctx_ranks=2, chunks=1, restarts=1, errs=1, partials=1),
    _world("ctx2-gen2-err-dup", ctx_ranks=2, gen_ranks=2, chunks=1, errs=1, partials=1, dups=1),
    _world("tp1x2-requests-reorder", requests=2, chunks=1, reorders=1),
    _world("tp1-restart-cancel-deadline", chunks=2, window=2, restarts=1, cancels=1, expiries=1),
    _world("tp1-restart-dup-cancel", chunks=2, restarts=1, dups=1, cancels=1),
    _world("ctx2-gen2-restart", ctx_ranks=2, gen_ranks=2, chunks=1, restarts=1),
    _world("ctx2-gen1-reorder-cancel", ctx_ranks=2, chunks=1, reorders=1, cancels=1),
    _world("tp1-err-cancel-deadline", chunks=2, window=2, errs=1, partials=1, cancels=1, expiries=1),
    _world("tp1-err-dup-cancel", chunks=2, window=2, errs=1, partials=1, dups=1, cancels=1),
    _world("tp1-restart-err-cancel", chunks=2, restarts=1, errs=1, partials=1, cancels=1),
    _world("ctx2-gen2-cancel", ctx_ranks=2, gen_ranks=2, chunks=1, cancels=1),
    _world("tp1-reorder-cancel-deadline", chunks=2, reorders=1, cancels=1, expiries=1),
    _world("ctx2-gen1-dup-reorder", ctx_ranks=2, chunks=1, dups=1, reorders=1),
    # One instance short of blocks: it refuses the second admission, and the
    # pairing vetoes it on the GEN side or undoes the CTX's.
    _world("tp1x2-ctx-short-cancel", requests=2, ctx_blocks=1, chunks=1, cancels=1),
    _world("tp1x2-gen-short-cancel", requests=2, gen_blocks=1, chunks=1, cancels=1),
    _world("ctx2x2-gen-short", ctx_ranks=2, requests=2, gen_blocks=1, chunks=1),
]

#: Two CTX instances (a fleet's) and one GEN instance, a handoff from each:
#: a rank death in one CTX instance, or a cancel, ends no handoff of the
#: other (the bystander check), and everything else holds. CI runs them
#: beside the default (~100,000 states).
_FLEET = [
    _world("fleet2-restart", ctx_instances=2, requests=2, chunks=1, restarts=1),
    _world("fleet2-cancel", ctx_instances=2, requests=2, chunks=1, cancels=1),
]

#: The direct path (one-rank CTX instances admit at the OPEN; no CTX round
#: admits, and the CTX leader learns of the admission from its rank's report).
_DIRECT = [
    _world("direct-tp1-cancel-deadline", direct=1, chunks=2, cancels=1, expiries=1),
    _world("direct-tp1-restart-dup-cancel", direct=1, chunks=2, restarts=1, dups=1, cancels=1),
    _world("direct-tp1-restart-reorder-err", direct=1, chunks=1, restarts=1, reorders=1, errs=1, partials=1),
    _world("direct-tp1x2-ctx-short-cancel", direct=1, requests=2, ctx_blocks=1, chunks=1, cancels=1),
    _world("direct-tp1x2-gen-short-dup", direct=1, requests=2, gen_blocks=1, chunks=1, dups=1),
    # A CTX rank without room refuses an OPEN; a copy of it comes once there
    # is room (the REJECT's promise: `CtxRank.refuse`).
    _world("direct-tp1x2-ctx-short-dup", direct=1, requests=2, ctx_blocks=1, chunks=1, dups=1),
    _world("direct-gen2-restart", direct=1, gen_ranks=2, chunks=1, restarts=1),
    _world("direct-gen2-cancel-reorder", direct=1, gen_ranks=2, chunks=1, cancels=1, reorders=1),
    _world("direct-fleet2-restart", direct=1, ctx_instances=2, requests=2, chunks=1, restarts=1),
]

#: Pull: each CTX rank lends its prefilled blocks to its edges' GEN ranks,
#: which READ them (the roles of the edge machines swap); a cancel on the
#: CTX side is a FENCE the reader answers. ~90,000 states, about 80 s on a
#: 2-core box (two worlds at a time).
_PULL = [
    _world("pull-tp1-cancel-deadline", pull=1, chunks=2, cancels=1, expiries=1),
    _world("pull-tp1-restart-dup-cancel", pull=1, chunks=2, restarts=1, dups=1, cancels=1),
    _world("pull-tp1-restart-reorder-err", pull=1, chunks=1, restarts=1, reorders=1, errs=1, partials=1),
    _world("pull-tp1-err-cancel-deadline", pull=1, chunks=2, window=2, errs=1, partials=1, cancels=1, expiries=1),
    _world("pull-tp1x2-gen-short-cancel", pull=1, requests=2, gen_blocks=1, chunks=1, cancels=1),
    _world("pull-gen2-restart", pull=1, gen_ranks=2, chunks=1, restarts=1),
    _world("pull-gen2-cancel-dup", pull=1, gen_ranks=2, chunks=1, cancels=1, dups=1),
    _world("pull-ctx2-gen1-cancel", pull=1, ctx_ranks=2, chunks=1, cancels=1),
    _world("pull-ctx2-gen1-deadline-reorder", pull=1, ctx_ranks=2, chunks=1, expiries=1, reorders=1),
    _world("pull-tp1-loss-cancel-deadline", pull=1, chunks=1, drops=1, cancels=1, expiries=1),
    _world("pull-tp1-loss2-deadline", pull=1, chunks=1, drops=2, expiries=1),
    _world("pull-ctx2-gen2-err-dup", pull=1, ctx_ranks=2, gen_ranks=2, chunks=1, errs=1, partials=1, dups=1),
    _world("pull-fleet2-restart", pull=1, ctx_instances=2, requests=2, chunks=1, restarts=1),
]

#: Named bounds. `default` is CI's; `quick` is what each planted bug is
#: explored with (it stops at the first violation); `large` runs on demand.
CONFIGS: dict[str, list[Config]] = {
    "smoke": [_world("tp1-cancel", chunks=2, cancels=1)],
    "default": _DEFAULT,
    "quick": [dataclasses.replace(c, max_states=4_000) for c in (*_DEFAULT, *_FLEET)],
    "fleet": _FLEET,
    "direct": _DIRECT,
    "pull": _PULL,
    "large": [
        _world("tp1-everything", chunks=2, window=2, restarts=1, errs=1, partials=1, dups=1, cancels=2, expiries=1),
        _world("tp2-everything", gen_ranks=2, chunks=1, restarts=1, errs=1, partials=1, dups=1, cancels=1, expiries=1),
        _world("tp2-cancel-deadline", gen_ranks=2, chunks=1, cancels=1, expiries=1),
        _world("tp1-err-dup-cancel-deadline", chunks=2, window=2, errs=1, partials=1, dups=1, cancels=1, expiries=1),
        _world("ctx2-gen1-restart-cancel", ctx_ranks=2, chunks=1, restarts=1, cancels=1),
        _world("ctx2-gen2-cancel-deadline", ctx_ranks=2, gen_ranks=2, chunks=1, cancels=1, expiries=1),
        _world("tp1x2-cancel-deadline-reorder", requests=2, chunks=1, cancels=1, expiries=1, reorders=1),
    ],
    # Frames lost between live ranks: outside the carriers' fault model (a Ray
    # call or a NIXL notification to a live actor is not lost), but a lost
    # frame must not cost more than a few timeouts: a GEN rank asks the writer
    # of an UNKNOWN edge again (`GenRank.expire`), so every quarantine it
    # starts ends, with a lost frame or two anywhere.
    "lossy": [
        _world("tp1-loss2-deadline", chunks=2, drops=2, expiries=1),
        _world("tp1-loss-cancel-deadline", chunks=2, drops=1, cancels=1, expiries=1),
        _world("tp1-loss-err-dup", chunks=2, window=2, drops=1, errs=1, partials=1, dups=1),
        _world("tp2-loss-cancel", gen_ranks=2, chunks=1, drops=1, cancels=1),
        _world("ctx2-loss-cancel", ctx_ranks=2, chunks=1, drops=1, cancels=1),
        _world("tp1x2-loss-reorder", requests=2, chunks=1, drops=1, reorders=1),
    ],
}

#: Protocol mutants of tests/mutation/mutants.toml the planted run plants,
#: one at a time: decisions the explorer must catch.
PLANTED = (
    "drain-done-while-in-flight",
    "chunk-failed-drain-in-flight",
    "all-chunks-done-early",
    "settle-any-terminal",
    "settle-ignores-unknown",
    "quarantine-releases",
    "release-skipped",
    "late-drain-too-early",
    "late-drain-ignored",
    "err-multi-descriptor-as-proof",
    "prepared-early",
    "table-unknown-not-absorbing",
    "cancel-decided-not-recorded",
    "rounds-prepared-first-rank",
    "gen-restart-hits-other-instances",
    "pairing-veto-ignored",
    "pairing-undo-skipped",
)


class Violation(Exception):
    """An invariant broke; `invariant` names it (S1, S3, S4, L1, L2, no-leak)."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


def _invariant_of(exc: BaseException) -> str:
    text = str(exc)
    for name in ("S1", "S2", "S3", "S4", "L1", "L2", "no leak", "pairing"):
        if text.startswith(name):
            return name
    return "S3" if not isinstance(exc, AssertionError) else "model"


Event = tuple[Any, ...]

_SESSION_MESSAGES = (Open, Ready, Cancel, Terminal, Receipt, Reject)

#: What a frame names, by its bytes (frames repeat across states): its
#: parent and its channel (the sender's incarnation, the receiver).
_FRAME_INFO: dict[bytes, tuple[ParentKey, tuple[Any, ...]]] = {}


def _frame_info(env: Envelope) -> tuple[ParentKey, tuple[Any, ...]]:
    info = _FRAME_INFO.get(env.frame)
    if info is None:
        message = decode_frame(env.frame)
        assert isinstance(message, _SESSION_MESSAGES), f"harness: a {type(message).__name__} on the wire"
        ticket = message.ticket
        sender = ticket.gen if env.to_role is Role.CTX else ticket.ctx
        channel = (env.to_role.value, env.to_rank, sender.ns.instance_id, sender.ns.rank, sender.epoch)
        if len(_FRAME_INFO) > 100_000:
            _FRAME_INFO.clear()
        info = _FRAME_INFO[env.frame] = (ticket.parent, channel)
    return info


class World(Pair):
    """The pair model plus the budgets and per-request progress of one exploration."""

    def __init__(self, config: Config) -> None:
        super().__init__(
            n_gen=config.gen_ranks,
            n_ctx=config.ctx_ranks,
            ctx_instances=config.ctx_instances,
            ctx_blocks=config.ctx_blocks or config.requests,
            gen_blocks=config.gen_blocks or config.requests,
            chunk_window=config.window,
            timeout=10.0,
            not_started_verdict=bool(config.verdict),
            direct=bool(config.direct),
            pull=bool(config.pull),
        )
        self.config = config
        self.budget = {
            "cancel": config.cancels,
            "drop": config.drops,
            "dup": config.dups,
            "err": config.errs,
            "partial": config.partials,
            "expire": config.expiries,
            "restart": config.restarts,
            "reorder": config.reorders,
        }
        self.requests = [parent_key(n) for n in range(1, config.requests + 1)]
        self.admitted: set[ParentKey] = set()
        self.restarted_gens: list[tuple[int, int]] = []  # (rank, old epoch) not yet confirmed dead
        self.restarted_ctx: list[tuple[int, int]] = []  # (rank, old epoch) not yet confirmed dead
        # For the bystander check: requests a fault touched (a cancel, an
        # ERR, a lost, duplicated or reordered frame of theirs, a deadline
        # for all, a GEN death for all) and CTX
        # instances that lost a rank. Any other request must not be failed
        # or cancelled by a round.
        self.touched: set[ParentKey] = set()
        self.faulted: set[int] = set()
        #: Only a fleet world tracks them: in the others they would split
        #: states that differ in nothing else (and double the space).
        self.bystanders = config.ctx_instances > 1
        self.settling = False

    # ---- the events --------------------------------------------------

    def events(self) -> list[Event]:
        """Every event enabled now (duplicates of one frame listed once)."""
        out: list[Event] = []
        for p in self.requests:
            if p not in self.admitted:
                out.append(("admit", p))
                continue
            for c, ctx in enumerate(self.ctxs):
                if ctx.parents().get(p) is ParentState.ADMITTED:
                    out.append(("prefill", p, c))
                if self.pull and ctx.parents().get(p) is ParentState.RESIDENT and not ctx.is_cancelled(p):
                    out.append(("lend", p, c))
            for g, gen in enumerate(self.gens):
                if gen.parents().get(p) is ParentState.ADMITTED and (not self.pull or self.lent_to(p, g)):
                    out.append(("install", p, g))
            if self.all_prepared(p):  # a one-rank CTX instance decides alone
                out.append(("decide", p))
            if p in self.decode_ready:
                out.append(("free", p))
            if self.budget["cancel"]:
                for r, rank in enumerate(self.ranks()):
                    if p in rank.parents():
                        out.append(("cancel", p, r))
        # Each carrier keeps a sender's order to one receiver (Ray calls from
        # one caller to one actor, NIXL notifications between two agents);
        # the receiving actor parks frames per parent, so per channel the
        # first frame of each parent may come next. Any other frame comes
        # next only out of order (the `reorder` budget).
        seen: set[bytes] = set()
        heads: set[tuple[Any, ...]] = set()
        for i, env in enumerate(self.queue):
            parent, channel = _frame_info(env)
            head = (channel, parent) not in heads
            heads.add((channel, parent))
            if env.frame in seen:
                continue
            seen.add(env.frame)
            if not self._parked(env) and (head or self.budget["reorder"]):
                out.append(("deliver", i))
            if self.budget["drop"]:
                out.append(("drop", i))
            if self.budget["dup"]:
                out.append(("dup", i))
        for key, write in self.in_flight.items():
            if not self.polled(write):
                continue  # nobody polls it any more
            out.append(("done", key))
            if self.budget["err"]:
                out.append(("err", key))
            if self.budget["partial"]:
                out.append(("partial", key))
        if self._rounds_due():
            out.append(("rounds",))
        if self.budget["expire"]:
            out.append(("expire",))
        if self.budget["restart"]:
            for g in range(len(self.gens)):
                out.append(("restart_gen", g))
            for c in range(len(self.ctxs)):
                out.append(("restart_ctx", c))
        for gen_rank, epoch in self.restarted_gens:
            out.append(("confirm_dead", gen_rank, epoch))
        for ctx_rank, epoch in self.restarted_ctx:
            out.append(("confirm_ctx_dead", ctx_rank, epoch))
        return out

    def apply(self, event: Event) -> object:
        """Run `event`; its label (`str()` reads it). Raises `Violation`."""
        try:
            label = self._apply(event)
        except Violation:
            raise
        except Exception as exc:  # the model's assertions name their invariant
            raise Violation(_invariant_of(exc), str(exc)) from exc
        self.actions.clear()
        self.errors.clear()
        return label

    def check(self) -> None:
        """S1, S4 and ownership in this state. Raises `Violation`."""
        try:
            self.check_s1()
            self.check_s4_and_ownership()
        except Exception as exc:
            raise Violation(_invariant_of(exc), str(exc)) from exc

    def _apply(self, event: Event) -> object:
        kind = event[0]
        if kind == "admit":
            p = event[1]
            self.admitted.add(p)
            instance = self.requests.index(p) % self.config.ctx_instances
            self.admit(p, blocks=1, chunks=self.config.chunks, lease=5.0, ctx_instance=instance)
            if self.direct:
                if p not in self.gens[0].parents():
                    self._touch(p)
                return f"the GEN instance admits {p.request_id} (its CTX rank admits at the OPEN)"
            if not all(p in rank.parents() for rank in (self.gens[0], self.ctxs[self.home_ranks(p)[0]])):
                self._touch(p)  # an instance refused it (no block): the pairing ends it
            return f"both instances admit {p.request_id} (each rank leases)"
        if kind == "prefill":
            self.prefill(event[1], event[2])
            return f"{self._who(event[2])} prefills {event[1].request_id}"
        if kind == "lend":
            self.lend(event[1], event[2])
            return f"{self._who(event[2])} lends {event[1].request_id} to its readers"
        if kind == "install":
            p, g = event[1], event[2]
            self._install_one(p, g)
            if self.pull:
                return f"GEN rank {g} installs {p.request_id} (posts its READs)"
            return f"GEN rank {g} installs {p.request_id} (sends its OPEN)"
        if kind == "decide":
            self.decide(event[1])
            return f"the CTX round decides {event[1].request_id} (READY, posts)"
        if kind == "free":
            self.free(event[1])
            self.decode_ready.discard(event[1])
            return f"the consumer frees {event[1].request_id}"
        if kind == "cancel":
            p, r = event[1], event[2]
            self.budget["cancel"] -= 1
            self._touch(p)
            rank = self.ranks()[r]
            self.perform(
                protocol_call("S3", f"cancel({p!r})", lambda: rank.cancel(p, CancelReason.CLIENT, self.now)),
                rank,
            )
            return f"{self._who(r)} cancels {p.request_id}"
        if kind in ("deliver", "drop", "dup"):
            i = event[1]
            env = self.queue[i]
            if kind == "drop":
                self.budget["drop"] -= 1
                self._touch(_frame_info(env)[0])
                del self.queue[i]
                return _FrameLabel("lost: ", env)
            if kind == "dup":
                self.budget["dup"] -= 1
                self._touch(_frame_info(env)[0])
                self.queue.append(Envelope(env.to_role, env.to_rank, env.frame))
                return _FrameLabel("duplicated: ", env)
            parent, channel = _frame_info(env)
            if any(_frame_info(e) == (parent, channel) for e in self.queue[:i]):
                self.budget["reorder"] -= 1  # it overtakes an earlier frame of its channel
                self._touch(parent)
            # S3: a refused frame changes nothing on the rank it is delivered to
            # (the only rank the delivery calls).
            receiver = self._receiver(env)
            before = receiver.snapshot() if receiver is not None else None
            queued = len(self.queue) - 1
            error = self.deliver(i)
            if error is not None:
                after = receiver.snapshot() if receiver is not None else None
                if after != before:
                    raise Violation("S3", f"refused {_FrameLabel('', env)} ({error!r}) changed state")
                suffix = f": refused ({type(error).__name__})" + (
                    ", REJECT sent" if len(self.queue) > queued else ""
                )
                return _FrameLabel("deliver ", env, suffix)
            return _FrameLabel("deliver ", env)
        if kind in ("done", "err", "partial"):
            key = event[1]
            ticket, index = key
            if kind != "done":
                self._touch(ticket.parent)
            what = f"chunk {index} of {ticket.request_id} ctx{ticket.ctx.ns.rank} -> gen{ticket.gen.ns.rank}"
            if kind == "partial":
                self.budget["partial"] -= 1
                self.fail_chunk_partially(key)
                return f"{what} fails part-way (its other writes may still land)"
            if kind == "err":
                self.budget["err"] -= 1
            self.finish_chunk(key, ok=kind == "done")
            return f"{what} {'DONE' if kind == 'done' else 'ERR'}"
        if kind == "rounds":
            self.run_rounds()
            return "a round (cancels, verdicts, completions)"
        if kind == "expire":
            self.budget["expire"] -= 1
            self._touch(*self.requests)
            self.now += self.timeout + 1
            self.expire()
            return "time passes every deadline (timers fire)"
        if kind == "restart_gen":
            g = event[1]
            self.budget["restart"] -= 1
            old = self.gens[g].our.epoch
            self._touch(*self.requests)
            self.restart_gen(g, notify=True)
            self.restarted_gens.append((g, old))
            return f"GEN rank {g} dies; epoch {old + 1} replaces it"
        if kind == "restart_ctx":
            c = event[1]
            self.budget["restart"] -= 1
            old = self.ctxs[c].our.epoch
            if self.bystanders:
                self.faulted.add(self.instance_of(c))
            self.restart_ctx(c, notify=True)
            self.restarted_ctx.append((c, old))
            return f"{self._who(c)} dies; epoch {old + 1} replaces it"
        if kind == "confirm_dead":
            g, epoch = event[1], event[2]
            self.restarted_gens.remove((g, epoch))
            self.confirm_gen_dead(g, epoch)
            return f"the directory confirms GEN rank {g} epoch {epoch} dead"
        if kind == "confirm_ctx_dead":
            c, epoch = event[1], event[2]
            self.restarted_ctx.remove((c, epoch))
            # Its process is gone and confirmed so: its writes land nowhere now.
            self.confirm_ctx_dead(c, epoch)
            return f"the directory confirms {self._who(c)} epoch {epoch} dead"
        raise ValueError(f"unknown event {event!r}")

    def _round(self, role: Any, *args: Any, **kwargs: Any) -> Any:
        """A round, and the bystander check on its decision: a request that
        no fault touched, in a CTX instance that lost no rank, is neither
        failed nor cancelled (a fault of one instance stays in it)."""
        decision = super()._round(role, *args, **kwargs)
        if self.settling or not self.bystanders:
            return decision  # settling passes every deadline: ends are due then
        for parent in (*decision.failed, *decision.cancelled):
            if parent not in self.touched and self.home.get(parent, 0) not in self.faulted:
                raise Violation(
                    "bystander",
                    f"the {getattr(role, 'value', role)} round ended {parent.request_id} (CTX instance"
                    f" {self.home.get(parent, 0)}), which no fault touched",
                )
        return decision

    def _touch(self, *parents: ParentKey) -> None:
        if self.bystanders:
            self.touched.update(parents)

    def _rounds_due(self) -> bool:
        """Whether a round would decide anything (`Pair.rounds_due`): a round
        with nothing to decide changes no state; it is not listed."""
        return self.rounds_due()

    def _parked(self, env: Envelope) -> bool:
        """The rank actor keeps a frame of a parent its rank leased but whose
        admission it has not applied (ADMITTED) until the parent moves on
        (`RankCore._park`): such a frame cannot be delivered yet."""
        rank = self._receiver(env)
        return rank is not None and rank.parents().get(_frame_info(env)[0]) is ParentState.ADMITTED

    def _receiver(self, env: Envelope) -> CtxRank | GenRank | None:
        """The rank `env` is addressed to (None: no such rank)."""
        ranks: list[Any] = self.ctxs if env.to_role is Role.CTX else self.gens
        return ranks[env.to_rank] if 0 <= env.to_rank < len(ranks) else None

    def _install_one(self, parent: ParentKey, g: int) -> None:
        self.install(parent, g)

    def _who(self, r: int) -> str:
        """The label of `ranks()[r]`."""
        if r < len(self.ctxs):
            instance, local = divmod(r, self.n_ctx)
            return f"CTX rank {local}" + (f" of ctx{instance}" if self.ctx_instances > 1 else "")
        return f"GEN rank {r - len(self.ctxs)}"

    # ---- canonical form, quiescence, the end ----------------------------

    def canonical(self) -> bytes:
        """The world as bytes: frames in flight sorted by channel (each
        channel in its order of sending), chunks in flight by key."""
        # Channels in a fixed order; within a channel, the order of sending.
        self.queue.sort(key=lambda e: _frame_info(e)[1])
        self.in_flight = dict(sorted(self.in_flight.items(), key=lambda kv: repr(kv[0])))
        # A set's iteration order (and so its pickle) depends on its history
        # and on string hashing: rebuild each in one order, so that equal
        # states pickle alike.
        self.normalize_rounds()
        self.decode_ready = set(sorted(self.decode_ready, key=repr))
        self.prepared = set(sorted(self.prepared, key=repr))
        self.admitted = set(sorted(self.admitted, key=repr))
        self.lent = dict(sorted(self.lent.items(), key=lambda kv: repr(kv[0])))
        self.dead_gens = set(sorted(self.dead_gens))
        self.dead_ctxs = set(sorted(self.dead_ctxs))
        self.touched = set(sorted(self.touched, key=repr))
        self.faulted = set(sorted(self.faulted))
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    def quiescent(self) -> bool:
        return not self.queue and not any(self.polled(w) for w in self.in_flight.values())

    def check_end(self) -> None:
        """L1 and L2 once everything settles: the directory confirms every
        death, then rounds, frees and every timer run until nothing moves."""
        self.settling = True
        try:
            # The directory confirms every dead incarnation in the end (fair).
            for gen_rank, epoch in list(self.restarted_gens):
                self._apply(("confirm_dead", gen_rank, epoch))
            for ctx_rank, epoch in list(self.restarted_ctx):
                self._apply(("confirm_ctx_dead", ctx_rank, epoch))
            self.settle_everything()
            for _ in range(3):  # whatever settling sent (a REJECT, a CANCEL) lands too
                self.pump()
                self.run_rounds()
                for p in sorted(self.decode_ready, key=repr):
                    self.free(p)
                self.decode_ready.clear()
            self.check_s1()
            self.check_s4_and_ownership()
        except Violation:
            raise
        except Exception as exc:
            raise Violation(_invariant_of(exc), str(exc)) from exc
        for role, leader in self.leaders.items():
            if leader.in_flight:
                held = sorted(p.request_id for p in leader.in_flight)
                name = role.value if isinstance(role, Role) else role
                raise Violation("L1", f"the {name} instance's rounds still hold {held} in flight after settling")
        strays = {w.ticket.parent for w in self.strays if self.polled(w)}
        for rank in self.ranks():
            for p, state in rank.parents().items():
                if state is not ParentState.QUARANTINED:
                    raise Violation("L1", f"{p.request_id} never ends on {rank.our.ns}: {state.value}")
                if p not in strays:
                    raise Violation(
                        "L2", f"{p.request_id} stays quarantined on {rank.our.ns} with no write that may still land"
                    )
            counts = rank.pool.counts()
            if counts.leased or counts.free + counts.quarantined != counts.total:
                raise Violation("L2", f"pool of {rank.our.ns} is {counts} after settling")


class _FrameLabel:
    """A step's label naming a frame, decoded only when a trace is read."""

    __slots__ = ("env", "prefix", "suffix")

    def __init__(self, prefix: str, env: Envelope, suffix: str = "") -> None:
        self.prefix, self.env, self.suffix = prefix, env, suffix

    def __str__(self) -> str:
        env = self.env
        return f"{self.prefix}{_frame(env)} -> {env.to_role.value}{env.to_rank}{self.suffix}"


def _frame(env: Envelope) -> str:
    message = decode_frame(env.frame)
    assert isinstance(message, _SESSION_MESSAGES), f"harness: a {type(message).__name__} on the wire"
    extra = ""
    if isinstance(message, Open):
        extra = f" gen-epoch {message.ticket.gen.epoch}"
    elif hasattr(message, "evidence"):
        extra = f" {message.evidence.value}"
    elif hasattr(message, "reason"):
        extra = f" {message.reason.value}"
    return f"{type(message).__name__.upper()} {message.ticket.request_id}{extra}"


@dataclasses.dataclass
class Result:
    config: Config
    states: int = 0
    transitions: int = 0
    depth: int = 0
    quiescent_checked: int = 0
    complete: bool = True  # False: a bound (max_states, max_depth) cut it short
    violations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.as_dict(),
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "quiescent_checked": self.quiescent_checked,
            "complete": self.complete,
            "violations": self.violations,
            "wall_s": round(self.seconds, 2),
        }


def explore(config: Config, *, stop_at_first: bool = True, max_violations: int = 5) -> Result:
    """Breadth-first over every interleaving of `config`'s world."""
    started = time.perf_counter()
    result = Result(config)
    root = World(config)
    blob = root.canonical()
    key = hashlib.blake2b(blob, digest_size=16).digest()
    came_from: dict[bytes, tuple[bytes | None, object]] = {key: (None, "")}
    frontier: list[tuple[bytes, bytes]] = [(blob, key)]

    def trace(last: bytes, step: str | None = None) -> list[str]:
        steps: list[str] = [] if step is None else [step]
        at: bytes | None = last
        while at is not None:
            prev, label = came_from[at]
            if prev is not None:
                steps.append(str(label))
            at = prev
        return steps[::-1]

    def report(exc: Violation, path: list[str]) -> bool:
        result.violations.append({"invariant": exc.invariant, "detail": exc.detail[:500], "trace": path})
        return stop_at_first or len(result.violations) >= max_violations

    depth = 0
    while frontier:
        if depth >= config.max_depth:
            result.complete = False
            break
        depth += 1
        next_frontier: list[tuple[bytes, bytes]] = []
        for blob, key in frontier:
            first: World = pickle.loads(blob)
            events = first.events()
            for n, event in enumerate(events):
                world: World = first if n == len(events) - 1 else pickle.loads(blob)
                result.transitions += 1
                try:
                    label = world.apply(event)
                except Violation as exc:
                    if report(exc, trace(key, _describe(event))):
                        result.states = len(came_from)
                        result.depth = depth
                        result.seconds = time.perf_counter() - started
                        return result
                    continue
                new_blob = world.canonical()
                new_key = hashlib.blake2b(new_blob, digest_size=16).digest()
                if new_key in came_from:
                    continue
                came_from[new_key] = (key, label)
                try:
                    world.check()
                except Violation as exc:
                    if report(exc, trace(new_key)):
                        result.states = len(came_from)
                        result.depth = depth
                        result.seconds = time.perf_counter() - started
                        return result
                    continue
                if world.quiescent():
                    result.quiescent_checked += 1
                    end: World = pickle.loads(new_blob)
                    try:
                        end.check_end()
                    except Violation as exc:
                        if report(exc, [*trace(new_key), "(settle: deaths confirmed, rounds, frees, every timer)"]):
                            result.states = len(came_from)
                            result.depth = depth
                            result.seconds = time.perf_counter() - started
                            return result
                if len(came_from) >= config.max_states:
                    result.complete = False
                    break
                next_frontier.append((new_blob, new_key))
            if len(came_from) >= config.max_states:
                break
        if len(came_from) >= config.max_states:
            result.complete = False
            break
        frontier = next_frontier
    result.states = len(came_from)
    result.depth = depth
    result.seconds = time.perf_counter() - started
    return result


def _describe(event: Event) -> str:
    parts = []
    for x in event:
        if isinstance(x, ParentKey):
            parts.append(x.request_id)
        elif isinstance(x, tuple) and x and hasattr(x[0], "request_id"):
            parts.append(f"chunk {x[1]} of {x[0].request_id} ctx{x[0].ctx.ns.rank} -> gen{x[0].gen.ns.rank}")
        else:
            parts.append(str(x))
    return " ".join(parts)


# ---- planted bugs --------------------------------------------------------------


def _planted_mutants(catalogue: pathlib.Path, ids: tuple[str, ...]) -> list[dict[str, Any]]:
    entries = {m["id"]: m for m in tomllib.loads(catalogue.read_text())["mutant"]}
    missing = [i for i in ids if i not in entries]
    if missing:
        raise SystemExit(f"kvhandoff explore: mutants not in {catalogue}: {missing}")
    return [entries[i] for i in ids]


def _scratch(root: pathlib.Path) -> pathlib.Path:
    """An import tree whose `kvhandoff` is a copy of `root`'s protocol and tools."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvhandoff-explore-"))
    package = scratch / "kvhandoff"
    package.mkdir()
    shutil.copy2(root / "pkg" / "__init__.py", package / "__init__.py")
    for layer in ("protocol", "topology", "tools"):
        shutil.copytree(root / layer, package / layer, ignore=shutil.ignore_patterns("__pycache__"))
    return scratch


def planted(catalogue: pathlib.Path, config_name: str, ids: tuple[str, ...] = PLANTED) -> dict[str, Any]:
    """Plant each mutant in a scratch copy of the source, explore, count the found."""
    root = catalogue.resolve().parents[2]
    rows = []
    for mutant in _planted_mutants(catalogue, ids):
        scratch = _scratch(root)
        try:
            target = scratch / "kvhandoff" / mutant["file"]
            source = target.read_text()
            if source.count(mutant["original"]) != 1:
                rows.append({"id": mutant["id"], "found": False, "error": "stale or ambiguous snippet"})
                continue
            target.write_text(source.replace(mutant["original"], mutant["replacement"]))
            env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
            out = subprocess.run(
                [sys.executable, "-m", "kvhandoff.tools.explore", "--json", "--first", "--config", config_name],
                cwd=scratch, env=env, capture_output=True, text=True, timeout=900,
            )
            try:
                report = json.loads(out.stdout)
            except json.JSONDecodeError:
                rows.append({"id": mutant["id"], "found": False, "error": (out.stderr or out.stdout)[-300:]})
                continue
            found = [v for v in report["violations"]]
            rows.append({
                "id": mutant["id"],
                "what": mutant.get("what", ""),
                "found": bool(found),
                "invariant": found[0]["invariant"] if found else None,
                "trace_steps": len(found[0]["trace"]) if found else None,
                "trace": found[0]["trace"] if found else None,
            })
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"found": sum(r["found"] for r in rows), "total": len(rows), "mutants": rows}


# ---- the command ---------------------------------------------------------------


def _explore_one(config: Config, stop_at_first: bool) -> Result:
    return explore(config, stop_at_first=stop_at_first)


def explore_all(configs: list[Config], *, stop_at_first: bool = True, first_only: bool = False) -> list[Result]:
    """Every world of `configs`, in parallel on the machine's cores (each world
    is independent). `first_only`: one at a time, stopping at the first world
    with a violation (the planted run)."""
    workers = min(len(configs), os.cpu_count() or 1)
    if first_only or workers <= 1:
        results = []
        for config in configs:
            results.append(explore(config, stop_at_first=stop_at_first))
            if first_only and results[-1].violations:
                break
        return results
    import concurrent.futures
    import multiprocessing

    # spawn: a fork of a process that runs Ray or threads is not safe. The
    # workers hash strings with one seed: a set's pickle follows its
    # iteration order, which string hashing changes, so equal worlds could
    # hash apart (more states, never fewer) by a different amount per run.
    # With one seed the counts repeat from run to run.
    context = multiprocessing.get_context("spawn")
    seed = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = "0"
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(pool.map(_explore_one, configs, [stop_at_first] * len(configs)))
    finally:
        if seed is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = seed


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    results = explore_all(CONFIGS[args.config], stop_at_first=not args.all, first_only=args.first)
    out: dict[str, Any] = {
        "configs": [r.as_dict() for r in results],
        "states": sum(r.states for r in results),
        "transitions": sum(r.transitions for r in results),
        "violations": [
            {"config": r.config.name, **v} for r in results for v in r.violations
        ],
    }
    if args.planted is not None:
        out["planted"] = planted(args.planted, args.planted_config)
    out["wall_s"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in results:
            print(
                f"{r.config.name:10} states {r.states:>8,}  transitions {r.transitions:>9,}  depth {r.depth:>3}"
                f"  {'complete' if r.complete else 'cut by a bound'}  {r.seconds:6.1f}s"
                f"  violations {len(r.violations)}"
            )
        for v in out["violations"]:
            print(f"\n{v['config']}: {v['invariant']} broke: {v['detail']}")
            for n, step in enumerate(v["trace"], 1):
                print(f"  {n:2}. {step}")
        if "planted" in out:
            p = out["planted"]
            print(f"\nplanted bugs found: {p['found']} of {p['total']}")
            for row in p["mutants"]:
                mark = "found" if row["found"] else "MISSED"
                steps = f" ({row['invariant']}, {row['trace_steps']} steps)" if row["found"] else ""
                print(f"  {mark:6} {row['id']}{steps}")
        print(f"\nstates {out['states']:,}, transitions {out['transitions']:,}, wall {out['wall_s']} s")
    missed = "planted" in out and out["planted"]["found"] < out["planted"]["total"]
    return 1 if out["violations"] or missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvhandoff explore", description=__doc__.split("\n")[0])
    add_explore_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

