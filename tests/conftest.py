"""Test-wide settings.

No property test may fail for being slow: Hypothesis' per-example deadline
and its data-generation health check measure the machine as much as the code;
CI runs on a shared 2-core box. Cost is the business of the benchmarks
(bench/) and of the relative bounds in tests/protocol/test_fuzz.py, so both
timing checks are off everywhere. Tests that set their own `@settings`
inherit this profile for what they leave unset.

The suite's verdict is its tests': the process ends with pytest's exit
status as soon as pytest has written its report, without the interpreter's
teardown. One pytest process starts and stops a local Ray cluster once per
test module (about thirty times); the interpreter's teardown after that,
with Ray's native core-worker state of every earlier session in memory, has
died of a segmentation fault after every test passed (CI, rc 139; Ray knows
the class: restarting Ray in one process is not safe while anything of an
earlier session is still referenced). What kvhandoff itself leaves behind is
tested where it can fail: `tests/actors/conftest.py` fails a module whose
deployments left a loop thread alive. `KVHANDOFF_TEST_NATURAL_EXIT=1` keeps
the normal teardown (with `PYTHONFAULTHANDLER=1`, a crash there prints every
thread's stack).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvhandoff",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvhandoff")

_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Last of all hooks: shut Ray down if a test left it up (its cluster's
    processes must not outlive us), then end with pytest's status."""
    if not _exit_status or os.environ.get("KVHANDOFF_TEST_NATURAL_EXIT") == "1":
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])
