"""The client API's own errors (`Deployment`, `Fleet`, `EngineDeployment`)."""

from __future__ import annotations

__all__ = [
    "DeploymentError",
    "InvalidRequest",
    "InvalidConfig",
    "LaunchFailed",
    "PlacementFailed",
    "DeploymentClosed",
    "StaleTicket",
]


class DeploymentError(Exception):
    """Base of the client API's own errors."""


class InvalidRequest(DeploymentError, ValueError):
    """A `handoff` argument that can never succeed (bad request id, token count,
    timeout or cancel phase). Raised before any actor call; nothing changed."""


class StaleTicket(DeploymentError, ValueError):
    """A ticket of another deployment or CTX topology (a front end that kept
    a ticket across a redeploy): refused before any call."""


class InvalidConfig(DeploymentError, ValueError):
    """A `launch` argument that can never work (TP that does not split the KV
    heads, an empty pool, VRAM without a GPU, ...). Raised before any actor starts."""


class LaunchFailed(DeploymentError):
    """The actors were started but the deployment did not come up. Everything
    the launch started was killed before this was raised. `not_started` maps
    "ctx rank 1" (and so on) to why it did not start, where that is known."""

    def __init__(self, deployment: str, reason: str, not_started: dict[str, str] | None = None) -> None:
        self.deployment = deployment
        self.reason = reason
        self.not_started = dict(not_started or {})
        detail = "; ".join(f"{who}: {why}" for who, why in self.not_started.items())
        super().__init__(f"deployment {deployment!r} did not start: {reason}" + (f" ({detail})" if detail else ""))


class PlacementFailed(LaunchFailed):
    """An instance's placement group was not placed within `timeout_s`: the
    cluster has no node (or no free node) with what its ranks need. No actor
    was started and the placement groups were removed before this was
    raised. Carries `role` ("ctx"/"gen"), `demand` (what the one node must
    hold), `label_selector` and `missing` (one line per reason: what the
    closest node lacks, or that no node matches the labels, or that the
    resources exist but are held by other work)."""

    def __init__(
        self,
        deployment: str,
        role: str,
        timeout_s: float,
        demand: dict[str, float],
        label_selector: dict[str, str],
        missing: tuple[str, ...],
    ) -> None:
        self.role = role
        self.timeout_s = timeout_s
        self.demand = dict(demand)
        self.label_selector = dict(label_selector)
        self.missing = tuple(missing)
        super().__init__(
            deployment,
            f"the {role} instance's placement group was not placed within {timeout_s:g}s: " + "; ".join(missing),
        )


class DeploymentClosed(DeploymentError):
    """The deployment was shut down: its actors are gone."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        super().__init__(f"deployment {deployment!r} is shut down")
