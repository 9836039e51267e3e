"""The bench's targets list, from a results dict (no Ray): the host-memory
ceiling of the staged mode and what the CPU target's note says about it."""

from __future__ import annotations

import math

from kvhandoff.actors._bench import _host_staged_ceiling, _targets


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
