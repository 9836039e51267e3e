"""Test-wide settings: no property test may fail for being slow.

Hypothesis' per-example deadline and its data-generation health check measure
the machine as much as the code; CI runs on a shared 2-core box. Cost is the
business of the benchmarks (bench/) and of the relative bounds in
tests/protocol/test_fuzz.py, so both timing checks are off everywhere. Tests
that set their own `@settings` inherit this profile for what they leave unset.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvhandoff",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvhandoff")
