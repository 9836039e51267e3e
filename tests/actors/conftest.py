"""Shared fixtures for the actor tests: one local Ray cluster per test module."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """A local Ray cluster (2 CPUs, no dashboard) shared by one test module.

    Test actors should ask for ``num_cpus=0`` so that many fit. If a cluster is
    already up in this process (another fixture or module left it), it is
    reused and left running.
    """
    started = not ray.is_initialized()
    if started:
        # address="local": a cluster of our own, even if `ray start` runs one on this machine
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        left = sorted(t.name for t in threading.enumerate() if t.name in _OWN_THREADS)
        if started:
            ray.shutdown()
    # After the shutdown: a loop thread a deployment left holds its tasks
    # (and their Ray references) into the next module's cluster.
    assert not left, f"a deployment's thread outlived the module: {left}"


#: The threads kvhandoff starts in a driver (`Deployment.launch_sync`'s loop,
#: the vLLM connector's control loop and engine stepper).
_OWN_THREADS = frozenset({"kvhandoff-loop", "kvhandoff-control", "vllm-engine"})
