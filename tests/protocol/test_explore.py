"""The interleaving explorer (`kvhandoff explore`, tools/explore.py) and the
hole it found: a REJECT proves a GEN edge that went UNKNOWN at its deadline.

The default bounds run here as CI's exhaustive check of the protocol: every
interleaving of every world in `CONFIGS["default"]`, S1-S4 in every state,
L1-L2 wherever the world is quiescent. A planted bug (a transition table row
broken in place) must be found, with a shortest trace.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from kvhandoff import protocol
from kvhandoff.protocol import CancelReason, EdgeState, ParentState
from kvhandoff.protocol import _edge_roles as edge_roles
from kvhandoff.protocol import _gen_session as gen_session
from kvhandoff.protocol import _session as session
from kvhandoff.tools import _flags
from kvhandoff.tools import explore as ex

from .harness import Pair, parent_key

ROOT = pathlib.Path(__file__).resolve().parents[2]
P = parent_key(1)


# ---- the hole the explorer found --------------------------------------------


def _open_waits_while_the_lease_runs_out() -> Pair:
    """The explorer's trace: the GEN sent its OPEN and cancelled; every
    deadline passed before the CTX saw the OPEN (its admission was never
    applied: the actor parked the OPEN until the lease ended)."""
    pair = Pair()
    pair.admit(P, blocks=1, chunks=1)
    pair.install(P)
    gen = pair.gens[0]
    pair.perform(gen.cancel(P, CancelReason.CLIENT, pair.now), gen)
    pair.now += pair.timeout + 1
    pair.expire()
    return pair


def test_a_reject_of_the_open_proves_an_edge_that_went_unknown() -> None:
    pair = _open_waits_while_the_lease_runs_out()
    gen = pair.gens[0]
    (edge,) = gen.edges(P).values()
    assert edge.state is EdgeState.UNKNOWN
    assert gen.parent_state(P) is ParentState.QUARANTINED
    pair.deliver_all()  # the OPEN is refused (REJECT), then the REJECT lands
    assert any(type(e).__name__ == "IllegalTransition" for e in pair.errors)
    pair.settle_everything()
    pair.check_s1()
    pair.check_s4_and_ownership()
    assert P not in gen.parents()
    counts = gen.pool.counts()
    assert counts.free == counts.total, counts  # nothing stays quarantined


def test_a_duplicate_reject_still_proves_nothing() -> None:
    """A DUPLICATE reject says the CTX recorded an earlier copy of the OPEN:
    it may be writing, so an UNKNOWN edge stays UNKNOWN."""
    pair = _open_waits_while_the_lease_runs_out()
    gen = pair.gens[0]
    (ticket,) = gen.edges(P)
    from kvhandoff.protocol import Reject, RejectReason

    gen.receive(Reject(ticket=ticket, reason=RejectReason.DUPLICATE), pair.now)
    assert gen.edges(P)[ticket].state is EdgeState.UNKNOWN
    assert gen.parent_state(P) is ParentState.QUARANTINED


# ---- the explorer ----------------------------------------------------------------


def _explore_json(config: str) -> dict[str, Any]:
    """`python -m kvhandoff.tools.explore --json --config <config>` in a child process: its report."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.tools.explore", "--json", "--config", config],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_the_default_bounds_hold_every_invariant() -> None:
    """CI's exhaustive run: at least 100,000 distinct states, no violation.

    In a child process, as a user runs it: its worker pool (one process per
    core) then never lives in the test process, which also holds Ray and
    NIXL (a pool there was followed by a crash at the test process's exit)."""
    out = _explore_json("default")
    assert out["violations"] == []
    assert out["states"] >= 100_000
    worlds = out["configs"]
    assert [w["config"]["name"] for w in worlds] == [c.name for c in ex.CONFIGS["default"]]
    assert all(w["quiescent_checked"] > 0 for w in worlds)  # L1/L2 were checked
    assert [w["config"]["name"] for w in worlds if not w["complete"]] == []  # every interleaving, to the end


def test_the_fleet_worlds_hold_every_invariant_and_no_fault_crosses_instances() -> None:
    """Two CTX instances and one GEN instance, a handoff from each, with a
    rank death anywhere or a cancel: every invariant holds, and no round
    ends a handoff that no fault touched in an instance that lost no rank
    (the bystander check; the planted `gen-restart-hits-other-instances`
    breaks it)."""
    out = _explore_json("fleet")
    assert out["violations"] == [] and out["states"] >= 50_000
    assert all(w["complete"] and w["config"]["ctx_instances"] == 2 for w in out["configs"])
    assert {"restarts", "cancels"} <= {k for w in out["configs"] for k in ("restarts", "cancels") if w["config"][k]}


def test_the_direct_path_worlds_hold_every_invariant() -> None:
    """The direct path (a one-rank CTX instance admits at the OPEN; no CTX
    round admits; its leader learns of the admission from the rank's
    report): every invariant holds with cancels, deadlines, deaths,
    duplicated and reordered frames, ERR, a pool too small on either side
    (the CTX refuses the OPEN with a REJECT after the GEN leased, and a
    copy of that OPEN comes later), a GEN
    instance of two ranks and two CTX instances."""
    out = _explore_json("direct")
    assert out["violations"] == [] and out["states"] >= 100_000
    worlds = out["configs"]
    assert all(w["complete"] and w["config"]["direct"] == 1 and w["quiescent_checked"] > 0 for w in worlds)
    faults = {k for w in worlds for k in ("restarts", "cancels", "dups", "reorders", "errs", "expiries") if w["config"][k]}
    assert faults == {"restarts", "cancels", "dups", "reorders", "errs", "expiries"}
    assert any(w["config"]["ctx_blocks"] for w in worlds) and any(w["config"]["ctx_instances"] == 2 for w in worlds)
    # A refused OPEN duplicated: its copy may come once the pool has room.
    assert any(w["config"]["ctx_blocks"] and w["config"]["dups"] for w in worlds)


def test_the_pull_worlds_hold_every_invariant() -> None:
    """Pull (the CTX ranks lend, the GEN ranks READ: the edge roles swap):
    every invariant holds with cancels on either side at any moment (a
    FENCE before, during or after the READ), deadlines, deaths of the
    reader or the lender, duplicated, reordered and lost frames, ERR and
    part-way failures of a READ, TP 1 -> 1, 1 -> 2, 2 -> 1, 2 -> 2, a pool
    too small, and two CTX instances (no fault crosses them)."""
    out = _explore_json("pull")
    assert out["violations"] == [] and out["states"] >= 80_000
    worlds = out["configs"]
    assert all(w["complete"] and w["config"]["pull"] == 1 and w["quiescent_checked"] > 0 for w in worlds)
    faults = {
        k
        for w in worlds
        for k in ("restarts", "cancels", "dups", "reorders", "drops", "errs", "partials", "expiries")
        if w["config"][k]
    }
    assert faults == {"restarts", "cancels", "dups", "reorders", "drops", "errs", "partials", "expiries"}
    assert {(w["config"]["ctx_ranks"], w["config"]["gen_ranks"]) for w in worlds} >= {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert any(w["config"]["ctx_instances"] == 2 for w in worlds)


def test_the_default_bounds_cover_every_topology_the_issue_names() -> None:
    """TP 1 -> 1, 1 -> 2, 2 -> 1 and 2 -> 2 (the CTX round deciding what every
    CTX rank reported prepared), each with cancels, deaths, deadlines and
    frame faults; two concurrent requests."""
    default = ex.CONFIGS["default"]
    shapes = {(w.ctx_ranks, w.gen_ranks) for w in default}
    assert shapes == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for shape in ((2, 1), (2, 2)):
        worlds = [w for w in default if (w.ctx_ranks, w.gen_ranks) == shape]
        for fault in ("cancels", "restarts", "errs", "partials", "dups"):
            assert any(getattr(w, fault) for w in worlds), (shape, fault)
    assert any(w.ctx_ranks == 2 and w.expiries and w.cancels for w in default)
    assert any(w.requests == 2 for w in default)


def test_a_planted_bug_is_found_with_a_shortest_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo the fix above in the GEN edge table: the explorer finds the
    quarantine that never ends, by the shortest trace there is."""
    table = dict(protocol.GEN_EDGE_TRANSITIONS)
    table[(EdgeState.UNKNOWN, protocol.EdgeEvent.REJECTED)] = table[
        (EdgeState.UNKNOWN, protocol.EdgeEvent.CANCEL)
    ]
    monkeypatch.setattr(gen_session.GenRank, "_edge_table", table)
    config = ex.Config("planted", cancels=1, dups=0, errs=0, restarts=0, chunks=1)
    result = ex.explore(config)
    assert result.violations, "the planted bug was not found"
    (violation,) = result.violations
    assert violation["invariant"] == "L2"
    trace = violation["trace"]
    # Shortest to a quiescent state (where L2 is judged): admit, install,
    # cancel, every deadline (the edge goes UNKNOWN and the GEN rank asks
    # again: its OPEN re-sent), the refused OPEN, the refused CANCEL, the
    # refused OPEN asked again, both REJECTs, then settle.
    assert len(trace) == 10, trace
    assert trace[0].startswith("both instances admit req-1")
    assert "cancels req-1" in trace[2]
    assert trace[3].startswith("time passes")
    assert "refused" in trace[4] and "REJECT sent" in trace[4]
    assert trace[6].startswith("deliver OPEN req-1") and "REJECT sent" in trace[6]
    assert trace[7].startswith("deliver REJECT req-1") and trace[8].startswith("deliver REJECT req-1")
    assert trace[9].startswith("(settle")
    # Without the bug the same bounds are clean, and complete.
    monkeypatch.undo()
    clean = ex.explore(config)
    assert clean.violations == [] and clean.complete


def test_a_refused_frame_that_changes_state_is_an_s3_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that records part of a frame before refusing it breaks S3."""
    def refusing(self: gen_session.GenRank, message: object, now: float) -> list[object]:
        self.pool.lease(parent_key(9), 1)
        raise protocol.UnknownSessionError("planted")

    monkeypatch.setattr(gen_session.GenRank, "receive_ready", refusing)
    result = ex.explore(ex.Config("s3", cancels=0, dups=0, errs=0, restarts=0, expiries=0, chunks=1))
    assert result.violations and result.violations[0]["invariant"] == "S3"


def test_a_lost_frame_anywhere_ends_every_quarantine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lossy worlds (frames lost between live ranks, with deadlines,
    cancels, ERRs, duplicates and a TP 2 GEN instance): every quarantine
    ends, because a GEN rank asks the writer of an UNKNOWN edge again. The
    largest lossy world (two requests) runs on demand: `--config lossy`."""
    worlds = [w for w in ex.CONFIGS["lossy"] if w.requests == 1]
    assert len(worlds) >= 4 and all(w.drops >= 1 for w in worlds)
    for world in worlds:
        result = ex.explore(world)
        assert result.violations == [] and result.complete, (world.name, result.violations[:1])
    # Without the asks, the first lost OPEN leaves a quarantine for good.
    monkeypatch.setattr(edge_roles, "UNKNOWN_ASKS", 0)
    (violation, *_) = ex.explore(worlds[0]).violations
    assert violation["invariant"] == "L2" and any(step.startswith("lost: OPEN") for step in violation["trace"])


def test_the_runtime_needs_no_topology_wide_not_started_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 (e): the rank actors never apply the round's NOT_STARTED
    verdict; each rank releases on its own evidence. The explorer models
    that (`verdict=0`, every default world) and finds nothing wrong. With
    the verdict on, it is never reached: the same states, and not one call
    (the decided cancel comes first and releases the parent on each rank).
    If this changes, docs/design.md "Who may free memory" must too."""
    calls: list[object] = []
    real = session._Rank.release_not_started

    def counted(self: session._Rank, parent: protocol.ParentKey) -> list[protocol.Action]:
        calls.append(parent)
        return real(self, parent)

    monkeypatch.setattr(session._Rank, "release_not_started", counted)
    assert all(w.verdict == 0 for w in ex.CONFIGS["default"])
    # One CTX rank, and two (the verdict then needs every CTX rank's proof).
    for name in ("tp1-reorder-cancel-deadline", "ctx2-gen2-cancel"):
        world = next(w for w in ex.CONFIGS["default"] if w.name == name)
        without = ex.explore(world)
        with_verdict = ex.explore(dataclasses.replace(world, verdict=1))
        assert without.violations == [] == with_verdict.violations
        assert without.complete and without.states == with_verdict.states > 1_000
    assert calls == []


def test_bounds_names_match_the_flags() -> None:
    assert tuple(sorted(ex.CONFIGS)) == _flags.CONFIG_NAMES


def test_planted_mutants_are_in_the_catalogue() -> None:
    rows = ex._planted_mutants(ROOT / "tests" / "mutation" / "mutants.toml", ex.PLANTED)
    assert len(rows) >= 8
    assert all(r["file"].startswith("protocol/") for r in rows)


def test_the_command_prints_the_documented_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", "explore", "--config", "smoke", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"configs", "states", "transitions", "violations", "wall_s"}
    assert out["violations"] == [] and out["states"] == out["configs"][0]["states"] > 100
    assert out["configs"][0]["config"]["name"] == "tp1-cancel"
