"""NIXL agent names of rank endpoints.

A module of its own so that the rank actors (actors/rank/), which name their
own agent and their peers', and the staged data plane (actors/_stager.py),
which checks the agent a staging notice comes from, share one definition
without importing each other.
"""

from __future__ import annotations

from kvhandoff.protocol import RankNamespace

__all__ = ["agent_name"]


def agent_name(deployment: str, ns: RankNamespace, epoch: int) -> str:
    """NIXL agent names are unique per endpoint epoch: a restarted rank is a new agent."""
    return f"{deployment}.{ns.instance_id}.{ns.role.value}{ns.rank}.e{epoch}"
