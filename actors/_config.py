"""What a launch is given: one typed value, checked in one place.

`LaunchConfig` (one CTX and one GEN instance, `Deployment.launch`),
`FleetConfig` (many of each, `Fleet.launch`), `EngineConfig` and
`EngineFleetConfig` (an engine's workers, `EngineDeployment.create`,
`EngineFleet.create`) share `_Transfer`; the first two also `_Common`. Each is a
frozen msgspec struct whose fields carry their constraints (msgspec `Meta`,
`Literal`) and whose cross-field rules sit in `__post_init__`; `checked`
builds one from a base config and keyword overrides, and turns every
violation into one `InvalidConfig` naming the field, before anything starts
(a struct built directly is checked again there: msgspec checks constraints
only when it converts).

What needs more than the fields (whether a TP splits the KV heads, whether
a memory kind fits the layout) is checked where the specs are built, still
before any actor starts.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from kvhandoff.actors._checks import short
from kvhandoff.actors._errors import InvalidConfig
from kvhandoff.actors.rank._config import DataPlane
from kvhandoff.topology import KVLayout

__all__ = ["LaunchConfig", "FleetConfig", "EngineConfig", "EngineFleetConfig", "checked", "staging_of"]

Positive = Annotated[int, Meta(ge=1)]
Count = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(gt=0)]
MemoryKindName = Literal["blocked", "paged", "paged_hnd", "split", "paged_interleaved"]
Carrier = Literal["ray", "nixl", "stream", "auto"]

C = TypeVar("C", bound="_Transfer")


class _Transfer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every client's ranks share: memory, chunks, bounds, carrier, name."""

    #: Where each rank's KV lives: host memory or a GPU.
    memory: Literal["DRAM", "VRAM"] = "DRAM"
    #: The most bytes one chunk (one NIXL WRITE) carries.
    chunk_bytes: Positive = 256 << 10
    #: A decided transfer's bound (0: none, which is outside the qualified scope).
    transfer_timeout_s: Annotated[float, Meta(ge=0)] = 10.0
    #: A CTX lease's bound while no round decided it.
    lease_timeout_s: Seconds = 30.0
    #: An agreement round's watchdog.
    round_timeout_s: Seconds = 5.0
    #: How control frames travel between ranks: "stream" (TCP per peer rank,
    #: actors/_stream.py), "ray", "nixl", or "auto" (measured at launch).
    control_frames: Carrier = "stream"
    #: The deployment's name (None: a fresh "kvh-…").
    name: str | None = None


class _Common(_Transfer, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a pair and a fleet of kvhandoff's own ranks share."""

    #: The model's KV shape and block size (None: `DEFAULT_LAYOUT`).
    layout: KVLayout | None = None
    #: KV blocks per rank.
    pool_blocks: Positive = 64
    #: How every rank lays its KV out, as an engine would (topology/_memory.py).
    memory_kind: MemoryKindName = "blocked"
    #: The whole start's bound (ranks constructed, registered, connected).
    start_timeout_s: Seconds = 600.0
    #: An instance's placement group's bound (`PlacementFailed`).
    placement_timeout_s: Seconds = 120.0
    #: Restarts of a rank before its instance fails.
    max_restarts: Count = 3
    #: Synthetic prefill and byte verification (S2); False times the protocol only.
    synthetic: bool = True
    #: VRAM: each rank's share of a GPU (a fraction in (0, 1], or whole GPUs).
    gpus_per_rank: Annotated[float, Meta(gt=0)] = 1.0
    #: Custom resources and label selectors that steer each role's instances.
    ctx_resources: dict[str, float] = {}
    gen_resources: dict[str, float] = {}
    ctx_labels: dict[str, str] = {}
    gen_labels: dict[str, str] = {}

    def __post_init__(self) -> None:
        if self.gpus_per_rank > 1 and self.gpus_per_rank != int(self.gpus_per_rank):
            raise ValueError(
                f"gpus_per_rank must be a fraction in (0, 1] or a whole number, got {self.gpus_per_rank!r}"
            )


class LaunchConfig(_Common, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One CTX instance and one GEN instance (`Deployment.launch`; the
    meaning of each field is in its docstring there)."""

    ctx_tp: Positive = 2
    gen_tp: Positive = 1
    #: NIXL descriptor lists prepared once per edge (False: built per chunk).
    prepared_descriptors: bool = True
    data_mode: Literal["auto", "direct", "staged"] = "auto"
    staging_window: Positive = 4
    staged_below: Count = 0
    staging_slot_bytes: Count = 0
    staged_min_descriptors: Count = 0
    #: Where the two instances go: Ray's choice, one node, or two nodes.
    placement: Literal["any", "pack", "spread"] = "any"
    #: TopologySpec fields per role (e.g. pp=2 for an unqualified pair).
    ctx_overrides: dict[str, Any] = {}
    gen_overrides: dict[str, Any] = {}
    #: The CTX rank admits at the OPEN (None: when ctx_tp is 1).
    admit_at_open: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.admit_at_open and self.ctx_tp != 1:
            raise ValueError(f"admit_at_open needs a CTX instance of one rank (ctx_tp=1), got ctx_tp={self.ctx_tp}")

    @property
    def admits_at_open(self) -> bool:
        return self.ctx_tp == 1 if self.admit_at_open is None else self.admit_at_open


class FleetConfig(_Common, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Many CTX and GEN instances (`Fleet.launch`): `ctx` and `gen` are the
    TP of each instance (a list) or how many instances of one rank (an int)."""

    ctx: list[Positive] | Positive = 1
    gen: list[Positive] | Positive = 1
    #: Every one-rank CTX instance admits at the OPEN.
    admit_at_open: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for role, value in (("ctx", self.ctx), ("gen", self.gen)):
            if isinstance(value, list) and not value:
                raise ValueError(f"{role} must name at least one instance, got []")

    def tps(self, role: str) -> list[int]:
        """The TP of each instance of `role` ("ctx" or "gen")."""
        value = self.ctx if role == "ctx" else self.gen
        return list(value) if isinstance(value, list) else [1] * value


class EngineFleetConfig(_Transfer, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An engine's fleet (`EngineFleet.create`): what every instance shares;
    the engine owns the KV tensors, laid out as `layout` says."""

    layout: KVLayout
    chunk_bytes: Positive = 1 << 20


class EngineConfig(EngineFleetConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One CTX and one GEN instance of an engine's workers
    (`EngineDeployment.create`): how each side's tensors hold the blocks,
    and the data plane, as for `LaunchConfig`."""

    ctx_tp: Positive
    gen_tp: Positive
    ctx_memory: MemoryKindName = "paged"
    gen_memory: MemoryKindName = "paged"
    data_mode: Literal["auto", "direct", "staged"] = "auto"
    staging_window: Positive = 4
    staged_below: Count = 0
    staging_slot_bytes: Count = 0
    staged_min_descriptors: Count = 0
    #: Between one-rank instances, the GEN rank READs the blocks the CTX
    #: rank lent it at `publish` (docs/design.md "Pull"); False: the GEN
    #: rank OPENs and the CTX rank WRITEs (push), as between larger ones.
    pull: bool = True
    #: Pull: how long a receive polls its READs right after posting them,
    #: before it leaves them to the rank's poll loop (`RankConfig.read_spin_s`).
    read_spin_s: Annotated[float, Meta(ge=0)] = 0.0005


#: The data-plane fields `LaunchConfig`, `EngineConfig`, `EnginePlan` and
#: `RankConfig` share, under the same names and meanings.
STAGING_FIELDS = tuple(DataPlane.__struct_fields__)


def staging_of(source: Any) -> dict[str, Any]:
    """The data-plane fields of ``source`` (a config or an `EnginePlan`), to
    pass on as keyword arguments."""
    return {name: getattr(source, name) for name in STAGING_FIELDS}


def checked(kind: type[C], base: C | None = None, /, **fields: Any) -> C:
    """A `kind` from `base` (or the defaults) with `fields` replacing its own,
    every constraint checked; raises `InvalidConfig` naming the first field
    that breaks one."""
    if base is not None and not isinstance(base, kind):
        raise InvalidConfig(f"expected a {kind.__name__}, got {type(base).__name__}")
    given = {**(msgspec.structs.asdict(base) if base is not None else {}), **fields}
    if given.get("layout") is not None and not isinstance(given["layout"], KVLayout):
        raise InvalidConfig(f"layout must be a KVLayout, got {short(given['layout'])}")
    try:
        return msgspec.convert(given, kind)
    except msgspec.ValidationError as exc:
        raise InvalidConfig(_explain(kind, str(exc), given)) from None


def _explain(kind: type[Any], message: str, given: dict[str, Any]) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.ctx_tp`" as "ctx_tp: expected
    `int` >= 1, got 0", with the choices of a field that has a few."""
    text, sep, where = message.partition(" - at `$.")
    if not sep:
        if message.startswith("Object contains unknown field"):
            return f"{kind.__name__} has no field {message.rpartition(' ')[2]}"
        if message.startswith("Object missing required field"):
            return f"{kind.__name__} needs {message.rpartition(' ')[2]}"
        return message
    field = where.rstrip("`").split(".")[0].split("[")[0]
    text = text[:1].lower() + text[1:]
    if field in given and "got" not in text and repr(given[field]) not in text:
        text += f", got {short(given[field])}"
    choices = _choices(kind, field)
    if choices:
        text += f" (one of {list(choices)})"
    return f"{field}: {text}"


def _choices(kind: type[Any], field: str) -> tuple[Any, ...]:
    hint = typing.get_type_hints(kind, include_extras=True).get(field)
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return ()
