"""How a rank applies one round decision to its sessions (sans-IO).

A `RoundDecision` names each parent once: rejected, admitted, decided,
cancelled, failed or completed (protocol/_rounds.py). A rank turns that into
calls on its `CtxRank` / `GenRank`, in one order, for the parents it holds.
The rank actor and the pair model (the protocol tests and the explorer) both
apply decisions through `decision_steps` and `apply_step`, so the rule is
written once and what the model proves is what the actor runs.

Only `Step.ADMITTED` is left to the caller: what follows an admission is the
role's own work (CTX: the engine's prefill, then `prefilled`; GEN: install the
edges and send the OPENs), done by the shell when it can.
"""

from __future__ import annotations

import enum
from collections.abc import Container

from ._messages import CancelReason
from ._rounds import RoundDecision
from ._session import Action, CtxRank, GenRank
from ._ticket import ParentKey

__all__ = ["Step", "decision_steps", "apply_step"]


class Step(enum.Enum):
    """One thing a decision asks of a rank about one parent."""

    WITHDRAW = "withdraw"  # rejected: give back what our vote leased
    ADMITTED = "admitted"  # the role's work (CTX prefill, GEN OPENs): the caller's
    DECIDED = "decided"  # CTX: every edge prepared on every rank; publish and post
    CANCELLED = "cancelled"  # a decided cancel: release once nothing can write
    FAILED = "failed"  # a decided failure: as a cancel, for the reason FAILURE
    COMPLETED = "completed"  # every rank finished: release (CTX), decode-ready (GEN)


#: The order a rank applies a decision in. The outcomes are disjoint, so the
#: order only matters between parents: withdrawals first (free blocks before
#: anything else), endings last.
_ORDER: tuple[tuple[Step, str], ...] = (
    (Step.WITHDRAW, "rejected"),
    (Step.ADMITTED, "admitted"),
    (Step.DECIDED, "decided"),
    (Step.CANCELLED, "cancelled"),
    (Step.FAILED, "failed"),
    (Step.COMPLETED, "completed"),
)


def decision_steps(decision: RoundDecision, live: Container[ParentKey]) -> list[tuple[Step, ParentKey]]:
    """The steps `decision` asks of a rank whose live parents are `live`
    (a parent this rank does not hold asks nothing of it), in apply order."""
    return [
        (step, parent)
        for step, field in _ORDER
        for parent in getattr(decision, field)
        if parent in live
    ]


def apply_step(side: CtxRank | GenRank, step: Step, parent: ParentKey, now: float) -> list[Action]:
    """Apply one step to `side`; the actions to perform. `Step.ADMITTED`
    asks nothing of the protocol here (returns no action): the caller does
    the role's work. A GEN rank has nothing to do for `Step.DECIDED`."""
    match step:
        case Step.WITHDRAW:
            return side.withdraw(parent)
        case Step.ADMITTED:
            return []
        case Step.DECIDED:
            return side.decided(parent, now) if isinstance(side, CtxRank) else []
        case Step.CANCELLED:
            return side.cancel(parent, CancelReason.CLIENT, now, from_round=True)
        case Step.FAILED:
            return side.cancel(parent, CancelReason.FAILURE, now, from_round=True)
        case Step.COMPLETED:
            return side.completed(parent, now)
    raise AssertionError(f"unknown step {step!r}")
