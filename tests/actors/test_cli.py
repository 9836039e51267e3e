"""`kvhandoff demo` and the Ray job example, end to end (subprocesses), plus the
demo's workload plan and invariant checks on synthetic reports (no Ray).

The end-to-end tests start their own local Ray cluster in a child process, so
they do not use the module's `ray_cluster` fixture.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.cli._demo import (
    DELAYED,
    EXACT_PHASES,
    DemoReport,
    Finished,
    Planned,
    check_invariants,
    plan_workload,
    render_summary,
)

ROOT = Path(__file__).resolve().parents[2]
# The fields the public contract (docs/design.md) and the brief promise in `--json`.
JSON_FIELDS = {
    "requests": int,
    "completed": int,
    "cancelled": int,
    "failed": int,
    "rejected": int,
    "bytes_verified": int,
    "leaked_blocks": int,
    "quarantined_blocks": int,
    "invariant_violations": list,
    "wall_s": float,
    "handoffs_per_s": float,
    "qualified": bool,
    "durations": dict,
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # always a fresh local cluster in the child
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "RAY_AUTH_MODE"):
        env.pop(name, None)  # no styling on request; the auth mode the CLI picks
    env["NIXL_LOG_LEVEL"] = "WARN"
    return env


# -- end to end -------------------------------------------------------------------------


@pytest.mark.ray
def test_demo_json_reports_every_field_and_holds_the_invariants() -> None:
    requests, seed = 24, 3
    argv = ["demo", "--json", "--requests", str(requests), "--seed", str(seed)]
    argv += [
        "--cancel-rate",
        "0.5",
        "--concurrency",
        "8",
        "--pool-blocks",
        "512",
        "--timeout",
        "10",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=_env(),
    )
    # Exactly one JSON object on stdout, nothing else.
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, (
        f"stdout must be one JSON line, got:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    report = json.loads(lines[0])
    for field, kind in JSON_FIELDS.items():
        assert field in report, f"missing {field}"
        assert isinstance(report[field], kind), f"{field}: {report[field]!r} is not {kind.__name__}"
    assert report["requests"] == requests
    outcomes = report["completed"] + report["cancelled"] + report["failed"] + report["rejected"]
    assert outcomes + report.get("timeout", 0) == requests
    # Every planned cancel kind shows up in the per-kind outcomes.
    plan = plan_workload(requests, 0.5, seed, exact_phases=report["config"]["cancel_at_phases"])
    kinds = {p.cancel for p in plan if p.cancel}
    assert kinds <= set(report["cancel_mix"]), report["cancel_mix"]
    if report["config"]["cancel_at_phases"]:
        assert set(EXACT_PHASES) <= kinds
    assert report["completed"] > 0 and report["bytes_verified"] > 0
    assert report["qualified"] is True
    durations = report["durations"]
    assert {"ray_init_s", "launch_s", "workload_s", "settle_s", "other_s", "total_s"} <= set(durations)
    # The parts add up to the wall time: what none measured is `other_s`.
    parts = sum(v for k, v in durations.items() if k != "total_s")
    assert parts == pytest.approx(durations["total_s"], abs=1e-6) and report["wall_s"] == durations["total_s"]
    assert report["notes"] == []
    # The invariants: exit 0 if and only if no violation; and here none may occur.
    assert (proc.returncode == 0) == (report["invariant_violations"] == [])
    assert report["invariant_violations"] == [], report["invariant_violations"]
    assert report["leaked_blocks"] == 0
    assert proc.returncode == 0, proc.stderr
    # With --json and success, stderr carries nothing (no progress bar, no Ray banners).
    assert proc.stderr.strip() == "", proc.stderr


@pytest.mark.ray
def test_fleet_demo_with_chaos_reports_the_storm_and_fails_no_bystander() -> None:
    """`kvhandoff demo --ctx-instances 2 --gen-instances 2 --chaos --json`: a
    fleet with mixed TP runs the workload through a membership storm (a rank
    killed, a coordinator killed, a replacement joining, an instance
    draining); the JSON carries instances, pairs, faults and
    bystander_failed, and the invariants hold."""
    requests = 60
    argv = ["demo", "--json", "--requests", str(requests), "--ctx-instances", "2", "--gen-instances", "2"]
    argv += ["--ctx-tp", "2,1", "--gen-tp", "1", "--chaos", "--concurrency", "6", "--pool-blocks", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", *argv],
        capture_output=True, text=True, timeout=400, cwd=ROOT, env=_env(),
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(lines[0])
    assert report["requests"] == requests
    assert sum(report["outcomes"].values()) == requests
    assert report["completed"] > 0 and report["bytes_verified"] > 0
    assert [f["kind"] for f in report["faults"]] == ["kill_rank", "kill_coordinator", "join", "drain"]
    assert all({"kind", "instance", "at_s"} <= set(f) for f in report["faults"])
    states = {(i["id"], i["incarnation"]): i["state"] for i in report["instances"]}
    assert states == {("ctx0", 1): "serving", ("ctx1", 1): "serving", ("gen0", 1): "removed", ("gen1", 2): "serving"}
    tps = {i["id"]: i["tp"] for i in report["instances"]}
    assert tps == {"ctx0": 2, "ctx1": 1, "gen0": 1, "gen1": 1}
    assert set(report["pairs"]) >= {"ctx0->gen0", "ctx1->gen0"}
    for counts in report["pairs"].values():
        assert set(counts) == {"completed", "cancelled", "failed"}
    assert report["bystander_failed"] == 0
    assert report["leaked_blocks"] == 0 and report["timeout"] == 0
    assert report["invariant_violations"] == [] and report["ok"] is True, report["invariant_violations"]
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.ray
def test_ray_job_example_runs_and_leaks_nothing() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "ray_job.py")],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=_env(),
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "job-2: completed" in proc.stdout
    assert "Token authentication" not in proc.stderr, proc.stderr  # RAY_AUTH_MODE is explicit
    assert "job-cancel-race:" in proc.stdout
    assert proc.stdout.strip().endswith("ok")


def _cli(*argv: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=_env(),
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--requests", "abc"],
        ["demo", "--cancel-rate", "lots"],
        ["demo", "--start-timeout", "0"],
        ["bench", "--start-timeout", "soon"],
    ],
    ids=" ".join,
)
def test_bad_flag_values_get_a_plain_error(argv: list[str]) -> None:
    """argparse names a type function that raised ValueError ("invalid
    _positive value"): every flag type says what it expected instead."""
    proc = _cli(*argv, timeout=60)
    assert proc.returncode == 2, proc
    assert "expected a" in proc.stderr and argv[1] in proc.stderr, proc.stderr
    assert "_positive" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.ray
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_launch_failure_is_one_line(command: str) -> None:
    """A configuration that can never work (3 ranks for 8 KV heads) is refused
    before any actor starts, in one line on stderr, exit status 2: with
    `--json` the only line; otherwise the last, after the progress lines.
    The demo refuses it before Ray starts, naming the TPs that fit."""
    quiet = command == "demo"
    extra = ["--json"] if quiet else ["--sections", "control"]
    proc = _cli(command, "--ctx-tp", "3", *extra)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    if quiet:
        assert lines == [
            "kvhandoff demo: --ctx-tp 3: cannot split 8 KV heads over tp=3: heads are not divisible by tp"
            " (tp that fit: 1, 2, 4, 8)"
        ], lines
        return
    assert lines[-1].startswith(f"kvhandoff {command}: could not launch the deployment: InvalidConfig"), lines
    assert sum("could not launch" in line for line in lines) == 1 and "Traceback" not in proc.stderr
    # progress: one line per step, each prefixed, none about the launch that failed
    assert all(line.startswith(f"kvhandoff {command}: ") for line in lines), lines
    assert not any("ranks ready" in line for line in lines), lines


@pytest.mark.ray
def test_demo_without_a_terminal_prints_progress_lines_and_a_plain_summary() -> None:
    """stderr is a pipe: progress is plain lines (starting Ray, launching, the
    requests, settling, stopping), the summary on stdout is a plain table, and
    nothing anywhere is an escape sequence. Five requests cancel in every way."""
    proc = _cli("demo", "--requests", "5", "--pool-blocks", "256", "--timeout", "10")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert all(line.startswith("kvhandoff demo: ") for line in lines), proc.stderr
    for expected in (
        r"starting a local Ray cluster \(2 CPUs\)\.\.\.",
        r"Ray ready \(\d+\.\d s\)",
        r"launching CTX tp=2 -> GEN tp=1 \(DRAM, NIXL/UCX\)\.\.\.",
        r"ranks ready \(\d+\.\d s\)",
        r"requests 5/5: .*",
        r"blocks settled \(\d+\.\d s\)",
        r"Ray stopped \(\d+\.\d s\)",
    ):
        assert any(re.fullmatch("kvhandoff demo: " + expected, line) for line in lines), (expected, lines)
    assert "Token authentication" not in proc.stderr
    summary = " ".join(proc.stdout.split())
    assert re.search(r"invariants OK", summary), proc.stdout
    for way in (*EXACT_PHASES, DELAYED):
        assert f"cancel {way}" in summary, (way, proc.stdout)
    assert re.search(r"wall time \d+\.\d s Ray start [\d.]+ \+ imports", summary), proc.stdout


# -- the plan and the checks, without Ray ---------------------------------------------------


def test_plan_is_deterministic_and_spreads_cancels_over_every_phase() -> None:
    plan = plan_workload(400, 0.3, seed=7, exact_phases=True)
    assert plan == plan_workload(400, 0.3, seed=7, exact_phases=True)
    assert len({p.request_id for p in plan}) == 400
    kinds = [p.cancel for p in plan if p.cancel]
    assert 0.2 < len(kinds) / 400 < 0.4
    assert set(kinds) == {*EXACT_PHASES, DELAYED}
    assert all(16 <= p.num_tokens <= 1024 for p in plan)
    without = plan_workload(100, 1.0, seed=7, exact_phases=False)
    assert {p.cancel for p in without} == {DELAYED}
    assert plan_workload(50, 0.0, seed=1, exact_phases=True)[0].cancel is None


def _rank(
    role: str, rank: int, *, free: int = 64, leased: int = 0, quarantined: int = 0, **kw: object
) -> dict:
    return {
        "role": role,
        "rank": rank,
        "pool": 64,
        "free": free,
        "leased": leased,
        "quarantined": quarantined,
        "violations": [],
        **kw,
    }


def _report(results: list[Finished], ranks: list[dict], *, settled: bool = True) -> DemoReport:
    return DemoReport(
        args={
            "ctx_tp": 2,
            "gen_tp": 1,
            "memory": "DRAM",
            "pool_blocks": 64,
            "chaos": False,
            "concurrency": 4,
            "cancel_rate": 0.3,
            "seed": 0,
        },
        qualified=True,
        unqualified_reasons=[],
        results=results,
        ranks=ranks,
        coordinators={"ctx": {"state": "running"}, "gen": {"state": "running"}},
        durations={"workload_s": 2.0, "total_s": 5.0},
        settled=settled,
        violations=[],
    )


def _done(i: int, outcome: str, cancel: str | None = None) -> Finished:
    return Finished(
        Planned(f"r{i}", 64, cancel),
        outcome,
        4096 if outcome == "completed" else 0,
        0.01 * (i + 1),
        0.1,
    )


def test_invariants_hold_on_a_clean_report_and_summary_says_so() -> None:
    report = _report(
        [_done(0, "completed"), _done(1, "cancelled", "mid_dma")],
        [_rank("ctx", 0), _rank("ctx", 1), _rank("gen", 0, free=60, quarantined=4)],
    )
    assert check_invariants(report) == []
    j = report.to_json()
    assert (j["completed"], j["cancelled"], j["leaked_blocks"], j["quarantined_blocks"]) == (
        1,
        1,
        0,
        4,
    )
    assert j["handoffs_per_s"] == 0.5 and j["latency_p50_s"] == pytest.approx(0.01)
    assert re.search(r"invariants\s+OK", render_summary(report))


def test_each_violated_invariant_is_reported() -> None:
    report = _report(
        [_done(0, "timeout", "mid_dma"), _done(1, "hung", DELAYED)],
        [
            _rank("ctx", 0, free=60, leased=4),
            {"error": "PoolError('block 3 in two states')"},
            _rank("gen", 0, violations=["S2: r9 block 2 holds foreign bytes"]),
        ],
        settled=False,
    )
    report.coordinators["gen"] = {"state": "failed", "failure_reason": "restart budget exhausted"}
    text = "\n".join(check_invariants(report))
    for tag in (
        "S4:",
        "L2: 4 blocks leaked",
        "S2:",
        "L1: r1",
        "L1: 1 requests timed out",
        "coordinator gen is failed",
    ):
        assert tag in text, tag
    report.violations = check_invariants(report)
    text = " ".join(render_summary(report).split())
    assert "invariants VIOLATED (6)" in text and "L2: 4 blocks leaked" in text
