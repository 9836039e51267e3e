"""`kvhandoff bench --plot DIR`: the three PNG plots from a real (short) bench
run, the samples behind them, and the refusals: a report without the
sections draws nothing, and `--plot` without matplotlib exits 2 before
anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.cli._plots import missing, write_plots
from tests.actors.test_cli import ROOT, _env

PNG = b"\x89PNG\r\n\x1a\n"
PLOTS = ("bandwidth.png", "latency_cdf.png", "pool_occupancy.png")


def _is_plot(path: Path) -> bool:
    data = path.read_bytes()
    return data.startswith(PNG) and len(data) > 10_000  # an empty figure is ~5 KB


def _report() -> dict:
    gb = lambda g: {"best_gbps": g, "median_gbps": g}  # noqa: E731
    return {
        "data": [{"size_mib": m, "e2e": gb(1.0 * m), "data": gb(2.0 * m), "raw": gb(3.0 * m), "copy": gb(5.0 * m)} for m in (4, 16, 64)],
        "paged": [{"block_kib": k, "raw": gb(k / 8), "direct": gb(k / 9), "staged": gb(3.0), "contiguous": gb(7.0), "copy": gb(9.0)} for k in (16, 64, 256)],
        "control": {"small_tokens": 16, "latency": {"samples_s": [0.03, 0.05, 0.04]}, "sustained": [{"concurrency": 4, "latency_samples_s": [0.06, 0.08]}]},
        "cancel": {"release_s": {"samples": [0.02, 0.03]}},
        "pools": [{"t": t, "section": "control", "ctx_free": 8 - t, "ctx_leased": t, "ctx_quarantined": 0, "gen_free": 8, "gen_leased": 0, "gen_quarantined": 0} for t in range(5)],
    }


def test_every_plot_is_drawn_from_a_report(tmp_path: Path) -> None:
    assert missing() is None
    written = write_plots(_report(), tmp_path / "plots")
    assert [p.name for p in written] == list(PLOTS)
    assert all(_is_plot(p) for p in written)


def test_a_report_without_the_sections_draws_nothing(tmp_path: Path) -> None:
    assert write_plots({"targets": []}, tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_exits_2_before_anything_starts(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvhandoff.cli import main\n"
        f"sys.exit(main(['bench', '--plot', {str(tmp_path)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc
    assert "needs matplotlib" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "starting a local Ray" not in proc.stderr  # refused before Ray


@pytest.mark.ray
@pytest.mark.slow
def test_bench_plot_writes_the_plots_of_a_real_run(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    argv = [
        "bench", "--json", "--sections", "data,control,cancel", "--sizes-mib", "4,16", "--repeats", "2",
        "--small-n", "10", "--concurrency", "1,4", "--sustain-s", "1", "--cancels", "6", "--ping-n", "200",
        "--plot", str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", *argv], capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert sorted(Path(p).name for p in report["plots"]) == sorted(PLOTS)
    assert all(_is_plot(out / name) for name in PLOTS)
    # The samples behind the plots: latencies of every small handoff, and pools
    # sampled in both sections whose counts add up to each pool (S4).
    assert len(report["control"]["latency"]["samples_s"]) == report["control"]["latency"]["n"] > 0
    assert {s["section"] for s in report["pools"]} == {"control", "cancel"}
    # The cancel trials start from whole pools (L1): nothing leaked before them
    # or in them, so each trial waited for every rank's release.
    assert all(b == 0 for b in report["cancel"]["leaked_blocks_per_rank"]), report["cancel"]
    assert report["cancel"]["not_released"] == 0, report["cancel"]
    for section in ("control", "cancel"):
        rows = [s for s in report["pools"] if s["section"] == section]
        for role in ("ctx", "gen"):
            totals = {s[f"{role}_free"] + s[f"{role}_leased"] + s[f"{role}_quarantined"] for s in rows}
            assert len(totals) == 1 and totals.pop() > 0, (section, role, rows[:3])
