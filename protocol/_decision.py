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

The rank's other two verdicts live here too, so the shell only performs
them: `admission_verdict` (how a rank votes on one proposed admission) and
`report_of` (what an action tells the rank's round follower, and the local
outcome it fixes). So does the pairing of two instances' admissions (the
coordinator performs it): `pairing_veto`, `pairing_undo` and
`paired_outcome`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from ._actions import Action, AdmissionStop, CancelIntent, LocalOutcome, ParentSettled
from ._ctx_session import CtxRank
from ._gen_session import GenRank
from ._messages import CancelReason
from ._negotiation import Negotiated, NegotiationOutcome, refusal_kind
from ._round_messages import RoundDecision
from ._rounds import News
from ._ticket import ParentKey

__all__ = [
    "Step",
    "decision_steps",
    "apply_step",
    "Admission",
    "admission_verdict",
    "Report",
    "report_of",
    "pairing_veto",
    "pairing_undo",
    "paired_outcome",
]


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


# -- the vote on one proposed admission ------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """How a rank votes on one proposed admission. `admit`: lease its blocks
    tentatively (the pool may still refuse). Otherwise `refusal` names why
    (the rank's stats counter), and `renegotiate` asks the shell to query
    the pair's protocol again (no agreement yet)."""

    admit: bool
    refusal: str = ""
    renegotiate: bool = False


ADMIT = Admission(True)


def admission_verdict(
    *,
    stopped: bool,
    peer: str,
    paired: bool,
    left: bool = False,
    admits_unpaired: bool = False,
    negotiation: NegotiationOutcome | None = None,
) -> Admission:
    """The vote on one admission, before any lease or DMA.

    - `stopped`: this rank's admission is stopped (`admission_stopped`);
    - `peer`: the instance the admission names ("" for none: a published
      engine ticket, claimed later by its first OPEN), `paired` whether this
      rank pairs with it, `left` whether that instance left the fleet;
    - `admits_unpaired`: this rank accepts admissions that name no instance;
    - `negotiation`: the pair's protocol outcome (None when unpaired).

    An instance we do not pair with, or one that left, is refused; so is a
    pair without an agreed protocol (asked again while it is pending)."""
    if stopped:
        return Admission(False, "admit_refused_stopped")
    if (not paired and (peer or not admits_unpaired)) or (paired and left):
        return Admission(False, "refused_unknown_instance")
    if paired and not isinstance(negotiation, Negotiated):
        if negotiation is None:
            return Admission(False, "refused_negotiation_pending", renegotiate=True)
        kind = refusal_kind(negotiation)
        return Admission(False, f"refused_negotiation_{kind}", renegotiate=kind == "pending")
    return ADMIT


# -- what an action tells the round follower ---------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    """What one action means for the rank's rounds and its waiters: the
    `news` its round follower records (None: none), and the local `outcome`
    the rank remembers now (None: none yet). An outcome that `overrides`
    replaces one recorded before (bytes that fail verification beat the
    protocol's cancel of the decided failure); otherwise the first wins."""

    parent: ParentKey
    news: News | None
    outcome: LocalOutcome | None = None
    overrides: bool = False


def report_of(action: Action, verified: Callable[[ParentKey], bool]) -> Report | None:
    """The `Report` of `action`, None for an action that tells the rounds
    nothing. `verified(parent)` checks the bytes of a parent that settled
    without a cancel (GEN: every byte checked, S2; CTX: always true); it is
    asked only then.

    - a cancel intent: news CANCEL (a union: one rank's report suffices);
    - an admission stop: news FAILURE;
    - a parent settled by a cancel: no news (its cancel is decided already),
      local outcome CANCELLED unless one was recorded first;
    - a parent settled otherwise: news COMPLETION if its bytes verify, else
      news FAILURE and local outcome FAILED, overriding."""
    match action:
        case CancelIntent(parent=parent):
            return Report(parent, News.CANCEL)
        case AdmissionStop(parent=parent):
            return Report(parent, News.FAILURE)
        case ParentSettled(parent=parent, cancelled=True):
            return Report(parent, None, LocalOutcome.CANCELLED)
        case ParentSettled(parent=parent):
            if verified(parent):
                return Report(parent, News.COMPLETION)
            return Report(parent, News.FAILURE, LocalOutcome.FAILED, overrides=True)
    return None


# -- pairing two instances' admissions --------------------------------------------
#
# A handoff is admitted by its CTX instance and its GEN instance together or
# not at all. The submitting instance's coordinator asks the peer instance to
# admit (in one call per peer) while its own ranks vote; then:


def pairing_veto(paired: Iterable[ParentKey], peer_admitted: Container[ParentKey]) -> frozenset[ParentKey]:
    """The paired admissions our round must refuse (`RoundLeader.close(vetoed=)`):
    those the peer instance did not admit."""
    return frozenset(p for p in paired if p not in peer_admitted)


def pairing_undo(peer_admitted: Iterable[ParentKey], admitted: Container[ParentKey]) -> list[ParentKey]:
    """What the peer instance admitted and our round did not: to cancel
    there (its blocks would otherwise wait for their lease to run out)."""
    return [p for p in peer_admitted if p not in admitted]


def paired_outcome(outcome: str, peer_failed: bool) -> str:
    """The outcome a submitter hears for its handoff: a refusal because the
    peer instance failed (died, broke, did not answer in time) is a failure,
    not a rejection (a rejection says: try again later)."""
    return "failed" if peer_failed and outcome == "rejected" else outcome
