"""Topology specs: the layout of one instance (docs/design.md "Vocabulary": topology).

A `TopologySpec` says everything about one engine instance that the handoff
protocol must agree on: its role, its parallelism (tp × pp × cp ranks), the
feature switches the qualified-scope gate looks at, the transfer backend and
timeout, and where its KV buffers live. Its canonical digest
(`topology/_digest.py`) goes into every `ContextTicket`, so two ranks that
disagree on any field here never authorize each other's work.

A spec cannot exist in a nonsense state: `__post_init__` validates every field
(types, bounds, cross-field rules) and normalizes the few spellings that would
otherwise make equal specs differ (a list of devices becomes a tuple, an int
timeout becomes a float, `-0.0` becomes `0.0`, role and memory strings become
their enums). msgspec runs `__post_init__` on construction, on decoding, on
`msgspec.convert` and on `msgspec.structs.replace`, so every path is checked.
Bad input raises `TopologyFieldError` (a `TopologyError`) naming the field.

Rank numbering: rank = (pp_index * cp + cp_index) * tp + tp_index, i.e. the
TP index varies fastest; `devices[rank]` is that rank's device.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from kvhandoff.protocol import MAX_ID_LEN, MemoryKind, Role, TopologyError

__all__ = [
    "TopologySpec",
    "TopologyFieldError",
    "make_topology",
    "validate_topology",
    "MAX_PARALLEL",
    "MAX_WORLD_SIZE",
    "MAX_DEVICE_ID",
    "MAX_TRANSFER_TIMEOUT_S",
    "MAX_BACKEND_LEN",
]

#: Largest tp, pp or cp accepted.
MAX_PARALLEL = 1024
#: Largest tp * pp * cp: ranks are `< 4096` everywhere in the protocol (`Rank`).
MAX_WORLD_SIZE = 4096
#: Device ids are `0 <= id < MAX_DEVICE_ID`, as in `BufferInfo.device`.
MAX_DEVICE_ID = 1024
#: A day: anything longer is a misconfiguration, not a timeout.
MAX_TRANSFER_TIMEOUT_S = 86400.0
#: Longest backend name ("UCX", "GDS", ...).
MAX_BACKEND_LEN = 32

# Same rule as protocol._ticket.Id, so an instance id always fits in a ticket.
_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")
_BACKEND_RE = re.compile(r"^[A-Za-z0-9_]+$")


class TopologyFieldError(TopologyError):
    """One field of a topology spec or KV layout is invalid.

    Carries `field` (the field name), `value` (what was given) and `problem`
    (why it is rejected) so a caller can report it without parsing text.
    """

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"{field}={value!r}: {problem}")
        self.field = field
        self.value = value
        self.problem = problem


def _check_int(field: str, value: object, lo: int, hi: int) -> int:
    # bool is an int subclass; `tp=True` is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TopologyFieldError(field, value, "must be an int")
    if not lo <= value <= hi:
        raise TopologyFieldError(field, value, f"must be in [{lo}, {hi}]")
    return value


def _check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TopologyFieldError(field, value, "must be a bool")
    return value


def _check_name(field: str, value: object, max_len: int, pattern: re.Pattern[str], chars: str) -> None:
    # The patterns are ASCII: a name that matches has as many bytes as chars.
    if not isinstance(value, str) or not pattern.match(value) or len(value) > max_len:
        raise TopologyFieldError(field, value, f"must be 1..{max_len} chars of [{chars}]")


class TopologySpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The layout of one instance (one engine of one role).

    Every field except `instance_id`, `role` and `tp` has a default that
    describes the qualified configuration (docs/design.md "Qualified scope"), so
    `TopologySpec(instance_id="ctx0", role=Role.CTX, tp=2)` is qualified.

    Fields:
        instance_id: the instance's id (same rule as a ticket id).
        role: CTX (prefill, writes KV) or GEN (decode, owns the destination).
        tp, pp, cp: tensor, pipeline and context parallelism, each in [1, 1024];
            `tp * pp * cp` (the world size) is at most 4096.
        attention_dp, layerwise, zero_copy, overlap: engine feature switches.
        transfer_timeout_s: seconds a posted transfer may take; finite and
            >= 0 (0 means "no timeout", which the gate does not qualify).
        backend: NIXL backend name, e.g. "UCX".
        buffers_preallocated: KV buffers are registered once up front.
        memory: where the KV buffers live (DRAM host memory or VRAM).
        devices: one device id per rank (`len == world_size`, all distinct),
            or empty: for DRAM it must be empty; for VRAM empty means
            "placement assigns GPU i to rank i".
    """

    instance_id: str
    role: Role
    tp: int
    pp: int = 1
    cp: int = 1
    attention_dp: bool = False
    layerwise: bool = False
    zero_copy: bool = False
    overlap: bool = True
    transfer_timeout_s: float = 30.0
    backend: str = "UCX"
    buffers_preallocated: bool = True
    memory: MemoryKind = MemoryKind.DRAM
    devices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_spec(self)

    @property
    def world_size(self) -> int:
        """Number of ranks: `tp * pp * cp`."""
        return self.tp * self.pp * self.cp


def _check_spec(spec: TopologySpec) -> None:
    """Validate and normalize `spec` in place (only through force_setattr, and
    only to canonical spellings of the same value)."""
    set_ = msgspec.structs.force_setattr

    if not isinstance(spec.instance_id, str):
        raise TopologyFieldError("instance_id", spec.instance_id, "must be a str")
    _check_name("instance_id", spec.instance_id, MAX_ID_LEN, _ID_RE, "A-Za-z0-9_.:-")
    _to_enum(spec, "role", Role)

    for field in ("tp", "pp", "cp"):
        _check_int(field, getattr(spec, field), 1, MAX_PARALLEL)
    if spec.world_size > MAX_WORLD_SIZE:
        raise TopologyFieldError(
            "tp*pp*cp", spec.world_size, f"world size must be at most {MAX_WORLD_SIZE}"
        )

    for field in ("attention_dp", "layerwise", "zero_copy", "overlap", "buffers_preallocated"):
        _check_bool(field, getattr(spec, field))

    timeout: Any = spec.transfer_timeout_s
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TopologyFieldError("transfer_timeout_s", timeout, "must be a number of seconds")
    if not math.isfinite(timeout) or not 0 <= timeout <= MAX_TRANSFER_TIMEOUT_S:
        raise TopologyFieldError(
            "transfer_timeout_s", timeout, f"must be finite and in [0, {MAX_TRANSFER_TIMEOUT_S}]"
        )
    # `+ 0.0` turns -0.0 into 0.0 and ints into floats: equal specs, equal digests.
    set_(spec, "transfer_timeout_s", float(timeout) + 0.0)

    _check_name("backend", spec.backend, MAX_BACKEND_LEN, _BACKEND_RE, "A-Za-z0-9_")
    _to_enum(spec, "memory", MemoryKind)

    devices: Any = spec.devices
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
        raise TopologyFieldError("devices", devices, "must be a sequence of device ids")
    devices = tuple(devices)
    for device in devices:
        _check_int("devices", device, 0, MAX_DEVICE_ID - 1)
    if devices:
        if spec.memory is MemoryKind.DRAM:
            raise TopologyFieldError("devices", devices, "must be empty for DRAM (host) buffers")
        if len(devices) != spec.world_size:
            raise TopologyFieldError(
                "devices",
                devices,
                f"needs one id per rank: {len(devices)} given, world size {spec.world_size}",
            )
        if len(set(devices)) != len(devices):
            raise TopologyFieldError("devices", devices, "two ranks on one device")
    set_(spec, "devices", devices)


def _to_enum(spec: TopologySpec, field: str, kind: type[enum.Enum]) -> None:
    """Set `spec.<field>` to its member of `kind` (a spelling of one's value)."""
    value = getattr(spec, field)
    try:
        msgspec.structs.force_setattr(spec, field, kind(value))
    except ValueError:
        allowed = " or ".join(repr(member.value) for member in kind)
        raise TopologyFieldError(field, value, f"must be {allowed}") from None


def make_topology(**fields: object) -> TopologySpec:
    """Build a `TopologySpec` from keyword fields.

    Like calling `TopologySpec(...)`, except that a missing or unknown field is
    a `TopologyError` too (the constructor raises a plain `TypeError` for those).
    """
    try:
        return TopologySpec(**fields)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TopologyError(f"bad topology fields: {exc}") from None


def validate_topology(spec: object) -> TopologySpec:
    """Check `spec` again and return it.

    Construction already validates, so this only fails for something that is
    not a `TopologySpec` or one mutated behind msgspec's back; use it at trust
    boundaries (e.g. a spec received from another process as a Python object).
    """
    if not isinstance(spec, TopologySpec):
        raise TopologyError(f"expected a TopologySpec, got {type(spec).__name__}")
    _check_spec(spec)
    return spec
