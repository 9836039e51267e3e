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

if TYPE_CHECKING:
    from ._config import EngineConfig, EngineFleetConfig, FleetConfig, LaunchConfig
    from ._coordinator import Coordinator
    from ._coordinator_errors import AdmissionStopped, RoundTimeout, TopologyFailed
    from ._errors import (
        DeploymentClosed,
        DeploymentError,
        InvalidConfig,
        InvalidRequest,
        LaunchFailed,
        PlacementFailed,
    )
    from ._faults import FaultPlan
    from .deployment import DEFAULT_LAYOUT, Deployment, HandoffResult, SyncDeployment
    from .endpoint import EnginePlan, ctx_endpoint, endpoint_actor, gen_endpoint
    from .engine import EngineDeployment, EngineResult, PublishRefused, StaleTicket
    from .engine_fleet import EngineFleet
    from .fleet import Fleet, InstanceUnavailable, UnknownInstance
    from .rank import ENDPOINT_METHODS, EndpointHost, RankActor, RankConfig


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


__all__ = [
    "Fleet",
    "EngineFleet",
    "UnknownInstance",
    "InstanceUnavailable",
    "EngineDeployment",
    "EngineConfig",
    "EngineFleetConfig",
    "EngineResult",
    "EnginePlan",
    "EndpointHost",
    "endpoint_actor",
    "ENDPOINT_METHODS",
    "ctx_endpoint",
    "gen_endpoint",
    "PublishRefused",
    "StaleTicket",
    "Deployment",
    "LaunchConfig",
    "FleetConfig",
    "SyncDeployment",
    "HandoffResult",
    "DEFAULT_LAYOUT",
    "DeploymentError",
    "InvalidRequest",
    "InvalidConfig",
    "LaunchFailed",
    "PlacementFailed",
    "DeploymentClosed",
    "FaultPlan",
    "RankActor",
    "RankConfig",
    "Coordinator",
    "AdmissionStopped",
    "RoundTimeout",
    "TopologyFailed",
]
