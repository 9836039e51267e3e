"""kvhandoff.actors: the I/O layer.

Ray actors (a rank actor per rank, `CtxRankCore` or `GenRankCore` as created
by `RankActor`, with its NIXL agent and preallocated KV buffer, a
`Coordinator` per instance), the NIXL data plane, the `Deployment`
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
from .rank import RankActor, RankConfig

__all__ = [
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
