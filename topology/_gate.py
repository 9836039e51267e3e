"""The qualified-scope gate (docs/design.md "Qualified scope").

The active protocol (in-flight cancel, early release, drain) runs only on the
configurations it has been qualified for: NIXL over UCX, preallocated buffers,
a positive transfer timeout, overlap on, PP=1, CP=1, attention-DP off,
layerwise off, zero-copy off. Everything else keeps the conservative path,
where a cancel waits for the transfer to finish.

The gate is a pure function of the topology and says *why*: `_CONDITIONS` is
one table of (requirement, reason) rows, evaluated in order, and every row
that fails contributes its own reason. A qualification with no reasons is
qualified; there is no other way to be qualified.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvhandoff.protocol import Role, TopologyError

from ._spec import TopologySpec

__all__ = ["Qualification", "qualify", "qualify_pair", "QUALIFIED_BACKEND"]

#: The only NIXL backend the active protocol is qualified on.
QUALIFIED_BACKEND = "UCX"

# (holds for a qualified spec, why it does not hold for this one)
_CONDITIONS: tuple[tuple[Callable[[TopologySpec], bool], Callable[[TopologySpec], str]], ...] = (
    (
        lambda s: s.backend == QUALIFIED_BACKEND,
        lambda s: f"backend is {s.backend!r}; only {QUALIFIED_BACKEND!r} is qualified",
    ),
    (
        lambda s: s.buffers_preallocated,
        lambda s: "KV buffers are not preallocated; registration must happen up front",
    ),
    (
        # The spec already guarantees a finite, non-negative timeout.
        lambda s: s.transfer_timeout_s > 0,
        lambda s: "transfer timeout is 0; a drain needs a positive bound",
    ),
    (
        lambda s: s.overlap,
        lambda s: "overlap is off",
    ),
    (
        lambda s: s.pp == 1,
        lambda s: f"pipeline parallelism is {s.pp}; only PP=1 is qualified",
    ),
    (
        lambda s: s.cp == 1,
        lambda s: f"context parallelism is {s.cp}; only CP=1 is qualified",
    ),
    (
        lambda s: not s.attention_dp,
        lambda s: "attention data parallelism is on",
    ),
    (
        lambda s: not s.layerwise,
        lambda s: "layerwise transfer is on",
    ),
    (
        lambda s: not s.zero_copy,
        lambda s: "zero-copy transfer is on",
    ),
)


class Qualification(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The gate's verdict: `reasons` lists every failed requirement, in table
    order; the topology is qualified iff there are none."""

    reasons: tuple[str, ...] = ()

    @property
    def qualified(self) -> bool:
        """True iff the active protocol may run (no reasons against it)."""
        return not self.reasons


def qualify(spec: TopologySpec) -> Qualification:
    """Decide whether one topology is in the qualified scope, and why not."""
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")
    return Qualification(
        reasons=tuple(reason(spec) for holds, reason in _CONDITIONS if not holds(spec))
    )


def qualify_pair(ctx_spec: TopologySpec, gen_spec: TopologySpec) -> Qualification:
    """Decide whether a CTX → GEN handoff may use the active protocol.

    Both sides must be qualified; each reason is prefixed with its side
    ("ctx: ..." / "gen: ..."). Passing the sides the wrong way round is a
    caller bug and raises `TopologyError` rather than returning a verdict.
    """
    ctx_q = qualify(ctx_spec)
    gen_q = qualify(gen_spec)
    if ctx_spec.role is not Role.CTX:
        raise TopologyError(f"ctx_spec {ctx_spec.instance_id!r} has role {ctx_spec.role.value}")
    if gen_spec.role is not Role.GEN:
        raise TopologyError(f"gen_spec {gen_spec.instance_id!r} has role {gen_spec.role.value}")
    return Qualification(
        reasons=tuple(f"ctx: {r}" for r in ctx_q.reasons)
        + tuple(f"gen: {r}" for r in gen_q.reasons)
    )
