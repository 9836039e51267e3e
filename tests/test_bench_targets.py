"""The bench's targets list, from a results dict (no Ray): the host-memory
ceiling of the staged mode and what the CPU target's note says about it."""

from __future__ import annotations

import math
from typing import Any

from kvhandoff.cli._bench import _host_staged_ceiling, _targets, render


def _row(copy: float, contiguous: float, direct: float, staged: float) -> dict:
    row = {
        "block_kib": 16,
        "copy": {"best_gbps": copy},
        "contiguous": {"best_gbps": contiguous},
        "direct": {"best_gbps": direct},
        "staged": {"best_gbps": staged},
        "staged_over_direct_best": staged / direct,
        "staged_over_contiguous_best": staged / contiguous,
        "auto_mode": "direct",
        "auto_over_contiguous_best": direct / contiguous,
    }
    _host_staged_ceiling(row)
    return row


def _cpu_target(row: dict) -> dict:
    out = {"machine": {"memory": "DRAM"}, "paged": [row]}
    return next(t for t in _targets(out) if t["target"].startswith("staged handoff / direct handoff @ 16 KiB"))


def test_the_host_ceiling_is_two_copies_and_a_write_per_byte() -> None:
    row = _row(copy=24.0, contiguous=12.0, direct=6.0, staged=4.0)
    assert math.isclose(row["staged_ceiling_gbps"], 1 / (2 / 24 + 1 / 12))  # 6 GB/s
    assert math.isclose(row["staged_ceiling_over_direct_best"], 1.0)
    t = _cpu_target(row)
    assert t["met"] is False and t["bound"] == 1.5
    assert t["note"].startswith("out of reach") and "1.00x direct" in t["note"]


def test_a_ceiling_above_the_bound_is_not_called_out_of_reach() -> None:
    row = _row(copy=60.0, contiguous=40.0, direct=5.0, staged=4.0)  # ceiling 17.1 GB/s = 3.4x
    t = _cpu_target(row)
    assert t["met"] is False
    assert t["note"].startswith("ceiling") and "out of reach" not in t["note"]


def test_no_ceiling_without_the_rates() -> None:
    row = {"copy": {}, "contiguous": {"best_gbps": 10.0}, "direct": {"best_gbps": 5.0}}
    _host_staged_ceiling(row)
    assert "staged_ceiling_gbps" not in row


def _scale(rates: list[tuple[int, float]], independent: float) -> dict:
    base = next(r for n, r in rates if n == 1)
    rows = [{"instances": n, "clients": 4 * n, "handoffs_per_s": r, "over_1x1": r / base, "latency_p50_s": 0.01} for n, r in rates]
    largest = max(r for n, r in rates if n == 4)
    return {
        "rows": rows,
        "independent": {"deployments": 4, "clients": 16, "handoffs_per_s": independent, "latency_p50_s": 0.02},
        "largest_over_independent": largest / independent,
    }


def test_scale_targets_carry_each_sizes_ratio_and_the_issues_bounds() -> None:
    """Each bound is the issue's (2x2 >= 1.8, 4x4 >= 2.8, 4x4 fleet >= 4
    independent pairs), on the GPU host's class; a small box is told whose
    target it is."""
    scale = _scale([(1, 100.0), (2, 190.0), (4, 300.0)], independent=320.0)
    out = {"machine": {"memory": "DRAM", "cpus": 16}, "scale": scale}
    targets = {t["target"]: t for t in _targets(out)}
    two = targets["fleet 2x2 / 1x1 aggregate handoffs/s"]
    four = targets["fleet 4x4 / 1x1 aggregate handoffs/s"]
    indep = targets["fleet 4x4 / 4 independent pairs, handoffs/s"]
    assert math.isclose(two["value"], 1.9) and two["met"] is True and two["bound"] == 1.8
    assert math.isclose(four["value"], 3.0) and four["met"] is True and four["bound"] == 2.8
    assert math.isclose(indep["value"], 300 / 320) and indep["met"] is False
    assert all(t["note"] == "" for t in (two, four, indep))
    # On a small box the note says whose target it is.
    out["machine"]["cpus"] = 2
    assert all(t["note"] == "GPU host target (16 cores)" for t in _targets(out) if t["target"].startswith("fleet"))


def _setup(key: str, rates: list[float]) -> Any:
    from kvhandoff.cli._bench_scale import _Setup

    async def stats() -> list[dict]:
        return []

    s = _Setup(key, 1, 1, [[("c", "")]], stats)
    s.windows = [
        {"handoffs_per_s": r, "completed": int(r), "seconds": 1.0, "_latencies": [0.01] * int(r),
         "_front_end_cpu_s": 0.0, "_host_busy_s": 1.0, "submits": {"calls": 1}}
        for r in rates
    ]
    return s


def test_a_scale_ratio_is_the_median_over_repeats_of_windows_measured_together() -> None:
    """A ratio pairs the windows of one repeat (a slow minute of the host
    hits both setups of that repeat) and takes the median over the repeats:
    one slow 1x1 window neither flatters the fleet (as the slowest 1x1 of the
    run would) nor sinks it (as the fastest would); the setup's figure is
    its median window."""
    from kvhandoff.cli._bench_scale import _ratio

    one = _setup("1x1", [100.0, 60.0, 110.0])  # the host was slow in repeat 2
    two = _setup("2x2", [190.0, 120.0, 200.0])
    ratio = _ratio(two, one)
    assert ratio["per_repeat"] == [1.9, 2.0, 1.818]
    assert math.isclose(ratio["median"], 1.9)
    summary = one.summary()
    assert summary["handoffs_per_s"] == 100.0 and summary["rates"] == [100.0, 60.0, 110.0]
    assert summary["completed"] == 270 and summary["cpu_per_handoff"]["host_busy_cores"] == 1.0


def test_scale_table_lists_every_size_and_the_independent_pairs() -> None:
    from kvhandoff.cli._bench_scale import scale_table

    scale = _scale([(1, 100.0), (2, 190.0), (4, 300.0)], independent=320.0)
    scale["rows"][0]["rates"] = [90.0, 100.0, 120.0]
    headers, rows = scale_table(scale)
    assert headers[0] == "setup" and [r[0] for r in rows] == ["fleet 1x1", "fleet 2x2", "fleet 4x4", "4 independent pairs"]
    assert headers[3] == "windows" and rows[0][3] == "90-120" and rows[1][3] == "-"


def _control(over_first: float, first_blocks: int = 128) -> dict:
    return {
        "latency_over_ping_p50": 5.0,
        "sustained_over_pipelined_best": 0.6,
        "blocks": {"rows": [
            {"blocks": first_blocks, "over_first_p50": 1.0},
            {"blocks": 8192, "over_first_p50": over_first},
        ]},
    }


def test_the_big_request_target_compares_8192_blocks_with_128() -> None:
    def big(out: dict) -> list[dict]:
        return [t for t in _targets(out) if "8,192-block" in t["target"]]

    (met,) = big({"machine": {"cpus": 2}, "control": _control(1.4)})
    assert met["met"] is True and met["bound"] == 1.5 and met["op"] == "<="
    (missed,) = big({"machine": {"cpus": 2}, "control": _control(1.6)})
    assert missed["met"] is False
    assert big({"machine": {"cpus": 2}, "control": _control(1.1, first_blocks=64)}) == []  # other sizes: no target


def test_the_engine_cost_target_bounds_the_idle_endpoint_only() -> None:
    def engine(idle: float, load: float) -> dict[str, dict]:
        out = {"engine": {"idle_over_none": idle, "load_over_none": load}}
        return {t["target"].split(" / ")[0]: t for t in _targets(out)}

    ok = engine(0.99, 0.5)
    assert ok["engine Python loop with an idle endpoint"]["met"] is True
    assert ok["engine Python loop under handoff load"]["met"] is True  # reported, not bounded
    assert engine(0.97, 0.9)["engine Python loop with an idle endpoint"]["met"] is False


def test_the_control_overhead_target_is_per_size_over_a_ping() -> None:
    def data(ratio: float, mib: int = 256) -> dict:
        return {"size_mib": mib, "e2e_over_raw_best": 1.0, "data_over_raw_best": 1.0,
                "control_overhead_over_ping_p50": ratio}

    def overhead(out: dict) -> list[dict]:
        return [t for t in _targets(out) if t["target"].startswith("control overhead")]

    (met,) = overhead({"machine": {"cpus": 16}, "data": [data(1.9)]})
    assert met["met"] is True and met["bound"] == 2.0 and "256 MiB" in met["target"]
    (missed,) = overhead({"machine": {"cpus": 16}, "data": [data(2.1)]})
    assert missed["met"] is False and missed["note"] == "GPU host"
    (small,) = overhead({"machine": {"cpus": 2}, "data": [data(3.0, mib=4)]})
    assert "4 MiB" in small["target"] and small["note"] == "GPU host target"
    assert overhead({"data": [{"size_mib": 1, "e2e_over_raw_best": 1.0, "data_over_raw_best": 1.0}]}) == []


def test_the_soak_target_is_the_largest_served_slope_after_the_warm_up() -> None:
    from kvhandoff.cli._bench_soak import GROWTH_BOUND, slope, soak_table

    # A slope is bytes per handoff, least squares: a flat line with one jump
    # reads small; a steady climb reads its rate.
    assert slope([0, 1, 2, 3], [10, 10, 10, 10]) == 0.0
    assert slope([0, 1000, 2000], [0, 64_000, 128_000]) == 64.0
    assert math.isnan(slope([1, 1, 1], [1, 2, 3])) and math.isnan(slope([1, 2], [1, 2]))
    samples = [
        {"t_s": t, "handoffs": 100 * t, "resident_bytes": {"gen0": 1000 * t, "driver": 5000 * t}}
        for t in range(10)
    ]
    soak = {
        "seconds": 10.0, "warmup_s": 4.0, "warmed_up": True, "handoffs": 900, "cancel_fraction": 0.3,
        "samples": samples, "growth_bytes_per_handoff": {"gen0": 10.0, "driver": 50.0},
        "max_growth_bytes_per_handoff": 10.0,
    }
    (target,) = [t for t in _targets({"soak": soak}) if t["target"].startswith("soak:")]
    assert target["met"] is True and target["bound"] == GROWTH_BOUND and target["op"] == "<="
    soak["max_growth_bytes_per_handoff"] = GROWTH_BOUND + 1
    soak["warmed_up"] = False
    (missed,) = [t for t in _targets({"soak": soak}) if t["target"].startswith("soak:")]
    assert missed["met"] is False and "NOT warmed up" in missed["note"]
    headers, rows = soak_table(soak)
    assert [r[0] for r in rows] == ["gen0", "driver"] and rows[0][2] == 4000 / (1 << 20)


def test_the_soak_warm_up_lasts_until_every_bounded_memory_forgets() -> None:
    from kvhandoff.cli._bench_soak import memories_full

    def memory(entries: int, by_age: int = 0, by_bytes: int = 0) -> dict[str, int]:
        return {"entries": entries, "bytes": 100 * entries, "dropped_by_age": by_age, "dropped_by_bytes": by_bytes}

    stats = {
        "coordinators": {"ctx": {"memory": {"resident_bytes": 1, "outcomes": memory(7, by_age=3), "peers": memory(0)}}},
        "ranks": [{"memory": {"outcomes": memory(7, by_bytes=1), "transfer_timings": memory(2)}}],
    }
    # The rank's timings still fill (nothing dropped yet): not warm.
    assert not memories_full(stats)
    stats["ranks"][0]["memory"]["transfer_timings"] = memory(2, by_age=1)
    # An empty memory (no peers in a one-pair deployment) never fills: not waited for.
    assert memories_full(stats)


def test_scale_table_shows_the_fleet_on_its_own_pairs_beside_the_independent_pairs() -> None:
    """The diagnostic row (the largest fleet, each front end on one pair)
    sits between the fleets and the independent pairs; it sets no target."""
    from kvhandoff.cli._bench_scale import scale_table, scale_targets

    scale = _scale([(1, 100.0), (4, 300.0)], independent=320.0)
    scale["own_pairs"] = {"instances": 4, "pairs": 4, "clients": 16, "handoffs_per_s": 310.0, "latency_p50_s": 0.02}
    _, rows = scale_table(scale)
    assert [r[0] for r in rows] == ["fleet 1x1", "fleet 4x4", "fleet 4x4, own pairs", "4 independent pairs"]
    assert rows[2][2] == "310"
    added: list[str] = []
    scale_targets(scale, "", lambda target, *_: added.append(target))
    assert not any("own" in t for t in added) and len(added) == 2


def test_scale_work_counts_each_process_kinds_cpu_and_the_host_is_read() -> None:
    """The CPU a handoff costs, by process kind and role (coordinators by
    their instance's name, ranks by their role), from `stats()` `cpu_s`; the
    host's busy CPU time from /proc/stat, which only grows."""
    import asyncio

    from kvhandoff.cli._bench_scale import _host_busy_s, _per_handoff, _work, scale_table

    def stats(cpu: float) -> dict:
        return {
            "coordinators": {"ctx0": {"rounds": 1, "cpu_s": cpu}, "gen1": {"rounds": 1, "cpu_s": 2 * cpu}},
            "ranks": [{"role": "ctx", "cpu_s": 3 * cpu, "counters": {}}, {"role": "gen", "cpu_s": 4 * cpu, "counters": {}}],
        }

    before, after = asyncio.run(_work([stats(1.0)])), asyncio.run(_work([stats(1.5)]))
    per = _per_handoff(before, after, 100)
    assert per == {"cpu_us_coord_ctx": 5000.0, "cpu_us_coord_gen": 10000.0, "cpu_us_rank_ctx": 15000.0, "cpu_us_rank_gen": 20000.0}
    first = _host_busy_s()
    assert first is not None and first > 0
    sum(i * i for i in range(200_000))
    second = _host_busy_s()
    assert second is not None and second >= first
    scale = _scale([(1, 100.0), (4, 300.0)], independent=320.0)
    scale["rows"][0]["cpu_per_handoff"] = {"front_ends_us": 900.0, "host_us": 12500.0, "host_busy_cores": 1.6}
    headers, rows = scale_table(scale)
    assert headers[-2:] == ["host CPU ms / handoff", "busy cores"] and rows[0][-2:] == ["12.50", "1.6"]


def test_a_target_not_met_says_why_under_the_table() -> None:
    """A missed sustained-rate target carries the reason (the calls a
    handoff costs, and no pipelining with one client); the rendered table
    numbers it and prints it under the targets; a met target carries none."""
    control = _control(1.0) | {
        "sustained_over_pipelined_best": 0.1,
        "per_handoff": {"ray_calls": 7.2},
        "sustained": [{"concurrency": 1}],
    }
    out = {"machine": {"cpus": 2, "memory": "DRAM", "loadavg_start": (0.5,), "loadavg_end": (0.7,)},
           "config": {"ctx_tp": 1, "gen_tp": 1}, "control": control, "notes": [], "wall_s": 17.0, "command_s": 21.0}
    out["targets"] = _targets(out)
    sustained = next(t for t in out["targets"] if t["target"].startswith("sustained"))
    assert sustained["met"] is False and "about 7 Ray calls" in sustained["why"]
    assert "at most 1 client" in sustained["why"]
    assert all("why" not in t for t in out["targets"] if t["met"])
    text = render({k: v for k, v in out.items() if k != "control"})  # the targets' part
    assert "| NOT met (1) |" in text and "(1) why not met: a small handoff costs about 7 Ray calls" in text
    assert "21 s in all (17 s measuring)" in text
    control["sustained"] = [{"concurrency": 1}, {"concurrency": 8}]
    assert "nothing is pipelined" not in next(t for t in _targets(out) if t["target"].startswith("sustained"))["why"]


def test_a_gpu_host_bound_missed_on_a_small_box_says_so_and_a_slow_end_to_end_names_the_control_time() -> None:
    row = {"size_mib": 64, "e2e_over_raw_best": 0.5, "data_over_raw_best": 0.97,
           "e2e": {"best_s": 0.012}, "control_overhead": {"p50_s": 0.006}, "control_overhead_over_ping_p50": 5.0}
    targets = {t["target"]: t for t in _targets({"machine": {"cpus": 2}, "data": [row]})}
    overhead = targets["control overhead (e2e - data phase) p50 @ 64 MiB / ping p50"]
    assert overhead["met"] is False and "this one has 2 CPUs" in overhead["why"]
    e2e = targets["handoff e2e / raw NIXL @ 64 MiB (best)"]
    assert e2e["met"] is False and "6.0 ms p50" in e2e["why"] and "50% of the best end to end" in e2e["why"]
    assert "why" not in targets["handoff data phase / raw NIXL @ 64 MiB (best)"]  # met
