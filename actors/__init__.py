"""kvhandoff.actors: the I/O layer.

The engine API (`EngineDeployment`, rank endpoints an engine's own actors
host over their own KV tensors: `EndpointHost`, `ctx_endpoint`,
`gen_endpoint`), kvhandoff's own rank actors (a host of a `CtxRankCore` or
`GenRankCore` as created by `RankActor`, over memory it allocates), a
`Coordinator` per instance, the NIXL data plane, the synthetic `Deployment`
client API (used by the CLI, the Ray job and the notebook) and the CLI.
"""

from ._coordinator import AdmissionStopped, Coordinator, RoundTimeout, TopologyFailed
from ._dataplane import FaultPlan
from .deployment import (
    DEFAULT_LAYOUT,
    Deployment,
    DeploymentClosed,
    DeploymentError,
    HandoffResult,
    InvalidConfig,
    InvalidRequest,
    LaunchFailed,
    SyncDeployment,
)
from .endpoint import EnginePlan, ctx_endpoint, endpoint_actor, gen_endpoint
from .engine import EngineDeployment, EngineResult, PublishRefused, StaleTicket
from .rank import ENDPOINT_METHODS, EndpointHost, RankActor, RankConfig

__all__ = [
    "EngineDeployment",
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
    "SyncDeployment",
    "HandoffResult",
    "DEFAULT_LAYOUT",
    "DeploymentError",
    "InvalidRequest",
    "InvalidConfig",
    "LaunchFailed",
    "DeploymentClosed",
    "FaultPlan",
    "RankActor",
    "RankConfig",
    "Coordinator",
    "AdmissionStopped",
    "RoundTimeout",
    "TopologyFailed",
]
