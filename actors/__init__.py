"""kvhandoff.actors: the I/O layer.

The engine API (`EngineDeployment`, rank endpoints an engine's own actors
host over their own KV tensors: `EndpointHost`, `ctx_endpoint`,
`gen_endpoint`), kvhandoff's own rank actors (a host of a `CtxRankCore` or
`GenRankCore` as created by `RankActor`, over memory it allocates), a
`Coordinator` per instance, the NIXL data plane and the synthetic
`Deployment` client API (used by the CLI, the Ray job and the notebook).
Only what runs in production: the `kvhandoff` command and its bench, demo
and test harness live in `kvhandoff.cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names load on first use (PEP 562), so `import kvhandoff.cli` and
# `kvhandoff --help` import no Ray, torch or NIXL. Each public name and the
# submodule that defines it:
_SOURCES = {
    "AdmissionStopped": "_coordinator_errors",
    "Coordinator": "_coordinator",
    "RoundTimeout": "_coordinator_errors",
    "TopologyFailed": "_coordinator_errors",
    "FaultPlan": "_faults",
    "LaunchConfig": "_config",
    "FleetConfig": "_config",
    "EngineConfig": "_config",
    "EngineFleetConfig": "_config",
    "DEFAULT_LAYOUT": "deployment",
    "Deployment": "deployment",
    "DeploymentClosed": "_errors",
    "DeploymentError": "_errors",
    "HandoffResult": "deployment",
    "InvalidConfig": "_errors",
    "InvalidRequest": "_errors",
    "LaunchFailed": "_errors",
    "PlacementFailed": "_errors",
    "SyncDeployment": "deployment",
    "EnginePlan": "endpoint",
    "ctx_endpoint": "endpoint",
    "endpoint_actor": "endpoint",
    "gen_endpoint": "endpoint",
    "EngineDeployment": "engine",
    "EngineFleet": "engine_fleet",
    "Fleet": "fleet",
    "InstanceUnavailable": "fleet",
    "UnknownInstance": "fleet",
    "EngineResult": "engine",
    "PublishRefused": "engine",
    "StaleTicket": "engine",
    "ENDPOINT_METHODS": "rank",
    "EndpointHost": "rank",
    "RankActor": "rank",
    "RankConfig": "rank",
}

if TYPE_CHECKING:  # what static checkers see; at run time `__getattr__` loads them
    from ._config import EngineConfig, EngineFleetConfig, FleetConfig, LaunchConfig  # noqa: F401
    from ._coordinator import Coordinator  # noqa: F401
    from ._coordinator_errors import AdmissionStopped, RoundTimeout, TopologyFailed  # noqa: F401
    from ._errors import (  # noqa: F401
        DeploymentClosed,
        DeploymentError,
        InvalidConfig,
        InvalidRequest,
        LaunchFailed,
        PlacementFailed,
    )
    from ._faults import FaultPlan  # noqa: F401
    from .deployment import DEFAULT_LAYOUT, Deployment, HandoffResult, SyncDeployment  # noqa: F401
    from .endpoint import EnginePlan, ctx_endpoint, endpoint_actor, gen_endpoint  # noqa: F401
    from .engine import EngineDeployment, EngineResult, PublishRefused, StaleTicket  # noqa: F401
    from .engine_fleet import EngineFleet  # noqa: F401
    from .fleet import Fleet, InstanceUnavailable, UnknownInstance  # noqa: F401
    from .rank import ENDPOINT_METHODS, EndpointHost, RankActor, RankConfig  # noqa: F401


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


#: The public names: exactly those `_SOURCES` loads.
__all__ = list(_SOURCES)

