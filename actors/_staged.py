"""The staged data plane's memory side: staging arenas, and the gather and
scatter of one chunk between a rank's KV memory and a slot.

A chunk of an edge is a run of rows of the edge's transfer order (row k =
block pair k // P, piece k % P, `plan_chunks`). Staged, the CTX rank copies
the chunk's pieces back to back into one slot of its arena (gather), ONE WRITE
moves the slot into the matching slot of the GEN rank's arena, and the GEN
rank copies them out into its blocks (scatter) in the same order. The piece
order, offsets and lengths come from the same `Piece` tuple on both sides, so
the slot needs no header.

Both copies are index copies over "units", the largest byte count that
divides every piece's offset and length and every region's block stride: a
region is viewed as rows of one unit and a chunk's pieces become index
vectors (`StageMap`), built once per chunk. On the host the gather is
`torch.index_select` into the slot and the scatter a numpy fancy assignment
(both run at memcpy speed for units of a few KiB; torch's CPU `index_copy_`
does not); on a GPU both are one torch kernel per region.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvhandoff.actors._dataplane import DataPlaneError, KVMemory, Piece, _piece_arrays

__all__ = ["StagingArena", "StageMap", "stage_map", "gather", "scatter", "stage_unit"]


class StagingArena:
    """`slots` slots of `slot_bytes` each, one contiguous uint8 tensor on
    `device` (registered with NIXL beside the KV memory, once)."""

    def __init__(self, slots: int, slot_bytes: int, device: str = "cpu") -> None:
        if slots <= 0 or slot_bytes <= 0 or slot_bytes % 8:
            raise DataPlaneError(f"a staging arena needs slots > 0 and slot_bytes a positive multiple of 8, got {slots} x {slot_bytes}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.tensor = torch.zeros((slots, slot_bytes), dtype=torch.uint8, device=device)
        self.base = self.tensor.data_ptr()
        self.is_cuda = self.tensor.is_cuda

    def slot(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.slots:
            raise DataPlaneError(f"slot {i} outside an arena of {self.slots}")
        return self.tensor[i]

    def addr(self, i: int) -> int:
        if not 0 <= i < self.slots:
            raise DataPlaneError(f"slot {i} outside an arena of {self.slots}")
        return self.base + i * self.slot_bytes


def stage_unit(pieces: Sequence[Piece], side: int, strides: Sequence[int]) -> int:
    """The unit of `side`'s (0 CTX, 1 GEN) index copies for `pieces`: the gcd
    of every piece offset and length on that side and every region stride
    they use (so each region is a whole number of units)."""
    g = 0
    regions = set()
    for p in pieces:
        region, offset = (p[0], p[1]) if side == 0 else (p[2], p[3])
        g = math.gcd(g, offset, p[4])
        regions.add(region)
    for r in regions:
        g = math.gcd(g, strides[r])
    if g <= 0:
        raise DataPlaneError("no pieces to stage")
    return g


@dataclasses.dataclass(frozen=True, eq=False)
class StageMap:
    """One chunk on one side: per region, the unit rows in the region and
    where they sit in the slot (None: the slot's rows in order, 0..n)."""

    unit: int
    nbytes: int
    parts: tuple[tuple[int, torch.Tensor, torch.Tensor | None], ...]
    #: numpy twins of the indices (host scatter).
    np_parts: tuple[tuple[int, np.ndarray, np.ndarray | None], ...]
    #: One region, one unit per row: row k of the map is unit k (`rows`).
    simple: bool = False

    def rows(self, start: int, end: int) -> StageMap:
        """The map of rows [start, end) of a `simple` map (a slice: no copy)."""
        if not self.simple or not 0 <= start <= end <= len(self.np_parts[0][1]):
            raise DataPlaneError(f"rows [{start}, {end}) of a map that cannot be sliced so")
        r, ridx, _ = self.parts[0]
        return StageMap(self.unit, (end - start) * self.unit, ((r, ridx[start:end], None),), ((r, self.np_parts[0][1][start:end], None),), True)


_SIDES: dict[tuple[tuple[Piece, ...], int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _side_arrays(pieces: Sequence[Piece], side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(region, offset, length) of every piece on `side`, int64 (cached per pieces)."""
    key = (tuple(pieces), side)
    found = _SIDES.get(key)
    if found is None:
        sr, so, dr, do, n = _piece_arrays(pieces)
        region, offset = (sr, so) if side == 0 else (dr, do)
        found = (region.astype(np.int64), offset.astype(np.int64), n.astype(np.int64))
        if len(_SIDES) > 256:
            _SIDES.clear()
        _SIDES[key] = found
    return found


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges: start[i] .. start[i] + count[i], in order."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def _to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """An index vector on `device`. To a GPU through pinned memory and an
    asynchronous copy: a copy from pageable memory would wait for every kernel
    queued on the stream (the gathers and scatters of the chunks before)."""
    t = torch.from_numpy(a)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def stage_map(
    pieces: Sequence[Piece], rows: np.ndarray, side: int, memory: KVMemory, unit: int, device: torch.device | str
) -> StageMap:
    """The index map of one chunk on `side` of `memory`: `rows` are the
    chunk's prepared-list indices on that side (block * P + piece, the
    `ChunkPlan.local` / `.remote` arrays), in transfer order."""
    p = len(pieces)
    region_of, offset_of, n = _side_arrays(pieces, side)
    rows = rows.astype(np.int64, copy=False)
    j = rows % p
    block = rows // p
    region = region_of[j]
    length = n[j]
    strides = np.array(memory.strides, dtype=np.int64)
    if len(region) and int(region.max()) >= len(strides):
        raise DataPlaneError(f"a piece names region {int(region.max())} of {len(strides)}")
    if len(block) and (int(block.min()) < 0 or int(block.max()) >= memory.num_blocks):
        raise DataPlaneError(f"a chunk names a block outside the pool of {memory.num_blocks}")
    start = (block * strides[region] + offset_of[j]) // unit
    count = length // unit
    if len(region_of) and not region_of.any() and (n == unit).all():
        # One region, every piece one unit (the common case): the rows are the units.
        return StageMap(unit, int(length.sum()), ((0, _to_device(start, device), None),), ((0, start, None),), True)
    slot_start = np.concatenate(([0], np.cumsum(count)[:-1])) if len(count) else count
    parts = []
    np_parts = []
    regions = np.unique(region)
    for r in regions.tolist():
        mask = region == r
        ridx = _expand(start[mask], count[mask])
        sidx: np.ndarray | None = _expand(slot_start[mask], count[mask])
        if len(regions) == 1:
            sidx = None  # every row of the slot, in order
        np_parts.append((r, ridx, sidx))
        parts.append(
            (
                r,
                _to_device(ridx, device),
                None if sidx is None else _to_device(sidx, device),
            )
        )
    return StageMap(unit, int(length.sum()), tuple(parts), tuple(np_parts))


def _word(unit: int, cuda: bool = False) -> torch.dtype:
    # 16-byte words on a GPU (a bit copy: index kernels never do arithmetic).
    if cuda and unit % 16 == 0:
        return torch.complex128
    return torch.int64 if unit % 8 == 0 else torch.int32 if unit % 4 == 0 else torch.uint8


def _rows(t: torch.Tensor, unit: int) -> torch.Tensor:
    """A flat uint8 tensor as rows of one unit, in the widest word that divides it."""
    dtype = _word(unit, t.is_cuda)
    size = torch.tensor([], dtype=dtype).element_size()
    return t.view(dtype).view(-1, unit // size) if dtype is not torch.uint8 else t.view(-1, unit)


def gather(memory: KVMemory, slot: torch.Tensor, m: StageMap) -> None:
    """Copy the chunk's pieces from `memory` into `slot` (back to back)."""
    if m.nbytes > slot.numel():
        raise DataPlaneError(f"a chunk of {m.nbytes} B does not fit a slot of {slot.numel()} B")
    out = _rows(slot[: m.nbytes], m.unit)
    for r, ridx, sidx in m.parts:
        src = _rows(memory.flat[r].view(-1), m.unit)
        if sidx is None:
            torch.index_select(src, 0, ridx, out=out)
        else:
            out.index_copy_(0, sidx, src.index_select(0, ridx))


def scatter(memory: KVMemory, slot: torch.Tensor, m: StageMap) -> None:
    """Copy `slot`'s bytes out into the chunk's pieces of `memory`."""
    if m.nbytes > slot.numel():
        raise DataPlaneError(f"a chunk of {m.nbytes} B does not fit a slot of {slot.numel()} B")
    if slot.is_cuda:
        src = _rows(slot[: m.nbytes], m.unit)
        for r, ridx, sidx in m.parts:
            dst = _rows(memory.flat[r].view(-1), m.unit)
            dst.index_copy_(0, ridx, src if sidx is None else src.index_select(0, sidx))
        return
    # Host: numpy's fancy assignment copies whole rows (torch's CPU index_copy_ does not).
    src_np = slot[: m.nbytes].numpy().reshape(-1, m.unit)
    for r, ridx, sidx in m.np_parts:
        dst = memory.flat[r].view(-1).numpy().reshape(-1, m.unit)
        dst[ridx] = src_np if sidx is None else src_np[sidx]
