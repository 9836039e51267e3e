"""The coordinator's errors and its `TopologyState` (part of the coordinator,
actors/_coordinator.py, which re-exports them)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from kvhandoff.protocol import RoundError

__all__ = [
    "CoordinatorError",
    "RoundTimeout",
    "AdmissionStopped",
    "TopologyFailed",
    "TopologyState",
    "InstanceDraining",
    "ParentInFlight",
]


class ParentInFlight(RoundError):
    """A submission or admission of a parent this coordinator still has
    pending, in flight or unanswered (a second receive of one ticket while
    the first is under way): refused, nothing changed, the first goes on."""


class CoordinatorError(Exception):
    """Base of the coordinator's errors (the actors layer; not protocol input errors)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the constructor arguments so the error survives a Ray hop intact
        # (a subclass names them; this class's own are its message).
        return (type(self), self._reduce_args or self.args)

    _reduce_args: tuple[Any, ...] = ()


class RoundTimeout(CoordinatorError):
    """Round ``round_no`` ended without a valid answer from ``missing_ranks``
    within the watchdog bound (``timeout_s``)."""

    def __init__(
        self, topology: str, round_no: int, missing_ranks: Sequence[int], timeout_s: float
    ) -> None:
        self._reduce_args = (topology, round_no, tuple(missing_ranks), timeout_s)
        super().__init__(
            f"topology {topology!r}: round {round_no} timed out after {timeout_s:g}s "
            f"waiting for ranks {list(missing_ranks)}"
        )
        self.topology = topology
        self.round_no = round_no
        self.missing_ranks = tuple(missing_ranks)
        self.timeout_s = timeout_s


class _TopologyError(CoordinatorError):
    """An error of ``topology`` for ``reason``; each kind words its message
    (``_message``, formatted with both)."""

    _message = "topology {topology!r}: {reason}"

    def __init__(self, topology: str, reason: str) -> None:
        self._reduce_args = (topology, reason)
        super().__init__(self._message.format(topology=topology, reason=reason))
        self.topology = topology
        self.reason = reason


class AdmissionStopped(_TopologyError):
    """Admission is stopped while the topology recovers from a failed rank."""

    _message = "topology {topology!r}: admission stopped ({reason}); retry later"


class TopologyFailed(_TopologyError):
    """The topology is FAILED (restart budget exhausted, or shut down): every
    call raises this."""

    _message = "topology {topology!r} failed: {reason}"


class InstanceDraining(AdmissionStopped):
    """The instance is draining (it leaves the fleet once its in-flight
    handoffs end): it admits nothing new. Not retried: route elsewhere."""


class TopologyState(str, enum.Enum):
    STARTING = "starting"  # rank actors not yet verified
    RUNNING = "running"  # rounds run, admission open
    DRAINING = "draining"  # no new admissions; in-flight handoffs finish (`drain`)
    RECOVERING = "recovering"  # a rank is being restarted: admission stopped
    FAILED = "failed"  # restart budget exhausted: every call raises TopologyFailed
    SHUT_DOWN = "shut_down"  # shutdown() was called
