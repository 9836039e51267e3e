"""The protocol layer's error types.

Every error raised by `kvhandoff.protocol` for bad input is a `ProtocolError`
subclass that carries the data explaining it (docs/design.md "Messages": every
decoding failure raises one documented error type and mutates no state).
`ProtocolError` itself is abstract: raise the subclass that says what went
wrong, so callers can tell a malformed frame from a stale ticket.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

__all__ = [
    "ProtocolError",
    "FrameError",
    "DecodeError",
    "NegotiationError",
    "StaleError",
    "UnknownSessionError",
    "IllegalTransition",
    "PoolError",
    "AdmissionRefused",
    "NoCapacity",
    "LeaseError",
    "RoundError",
    "TopologyError",
]


class ProtocolError(Exception):
    """Base of every error the protocol layer raises for bad input.

    Not raised directly: `ProtocolError("x")` is a TypeError. Catch it to
    catch everything the layer documents; raise a subclass.
    """

    #: The names of this class's constructor parameters when all are plain
    #: positional ones, else None (set for every subclass): `__reduce__`.
    _init_names: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, *args: object) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        super().__init__(*args)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        params = inspect.signature(cls).parameters.values()
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if all(p.kind in positional for p in params):
            cls._init_names = tuple(p.name for p in params)
        else:
            cls._init_names = None

    def __reduce__(self) -> str | tuple[Any, ...]:
        # Errors cross Ray hops by pickle: rebuild one from its constructor's
        # arguments, which every subclass keeps as attributes of the same
        # names. One whose constructor takes ``*args`` (or whose arguments are
        # not all kept) pickles as any exception does.
        if self._init_names is not None:
            try:
                return (type(self), tuple(getattr(self, name) for name in self._init_names))
            except AttributeError:
                pass
        return super().__reduce__()


def _detailed(text: str, detail: str) -> str:
    """`text`, followed by ``: detail`` when there is a detail."""
    return f"{text}: {detail}" if detail else text


class FrameError(ProtocolError):
    """A frame failed a structural check before any decoding (length, header, kind)."""


class DecodeError(ProtocolError):
    """A frame passed the structural checks but its body does not decode to the
    typed message its header announced (schema, bounds, unknown fields)."""


class NegotiationError(ProtocolError):
    """The ranks' descriptors admit no common protocol (version, capability, ABI).

    Raised before any DMA: a topology that cannot agree never moves bytes.
    """


class StaleError(ProtocolError):
    """A message names something that existed once but not now: an older
    attempt, epoch, slot generation or topology digest (invariant S3)."""

    def __init__(self, what: str, got: object, expected: object) -> None:
        super().__init__(f"stale {what}: got {got!r}, installed {expected!r}")
        self.what, self.got, self.expected = what, got, expected


class UnknownSessionError(ProtocolError):
    """A message names a session that was never installed here (default-deny)."""


class IllegalTransition(ProtocolError):
    """An event that the state machine's table has no entry for in this state."""

    def __init__(self, machine: str, state: object, event: object) -> None:
        super().__init__(f"{machine}: event {event!r} is illegal in state {state!r}")
        self.machine, self.state, self.event = machine, state, event


class PoolError(ProtocolError):
    """A block pool request that cannot be honoured (too few free blocks,
    wrong generation, a block not in the state the call needs)."""


class AdmissionRefused(PoolError):
    """An admission this rank will not make now, whatever its pool holds:
    its admission is stopped (quarantine at its limit), its instance drains,
    or it has not joined its instance's rounds yet. A REJECT carries it as
    ``admission_stopped``."""


class NoCapacity(AdmissionRefused):
    """An admission refused for want of free blocks (the pool holds fewer
    than it needs now). A REJECT carries it as ``no_capacity``."""


class LeaseError(ProtocolError):
    """A lease operation on an unknown lease, or one its owner may not do."""


class RoundError(ProtocolError):
    """An agreement-round message for an unknown, stale or already-applied round."""


class TopologyError(ProtocolError):
    """A topology, layout or shard mapping that is invalid or unsupported."""
