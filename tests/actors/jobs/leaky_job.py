"""A job for tests/actors/test_ray_job_submit.py: examples/ray_job.py with
one block reported leaked on the first rank (a fault-injecting wrapper around
the real stats; everything else is the real job). The job must fail: exit
status 1 and a FAILED line in its logs."""

from __future__ import annotations

import pathlib
import runpy
import sys
from typing import Any

from kvhandoff.actors.deployment import SyncDeployment

_real_stats = SyncDeployment.stats


def _leaky_stats(self: SyncDeployment) -> dict[str, Any]:
    stats = _real_stats(self)
    ranks = stats.get("ranks") or []
    if ranks and "free" in ranks[0]:
        ranks[0]["free"] -= 1  # one block neither free nor quarantined: leaked
        ranks[0]["leased"] = 0
    return stats


SyncDeployment.stats = _leaky_stats  # type: ignore[method-assign]
job = pathlib.Path(__file__).resolve().parents[3] / "examples" / "ray_job.py"
sys.argv = [str(job)]
runpy.run_path(str(job), run_name="__main__")
