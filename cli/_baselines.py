"""The bench's baselines, run inside a CTX rank's actor (not methods of it).

`kvhandoff bench` compares a handoff with (a) a raw NIXL WRITE of exactly
the regions a handoff moves, with the same agent, buffers and descriptors,
and no protocol; (b) a raw WRITE of the same bytes, contiguous (the link's
ceiling); (c) a plain in-process copy (the physical ceiling); and it reads
the data phase each handoff took on the CTX rank. These functions run on the
rank's endpoint through Ray's ``__ray_call__`` and `on_endpoint_loop` (see
`call_on`): a production rank actor has no method for them.

A WRITE's target must progress its NIXL worker (agents run without a
progress thread): `progressing` keeps every GEN rank's own poll sweeping at
its short interval for a while.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from kvhandoff.actors._dataplane import Chunk, DataPlaneError, NixlTransport, XferState, plan_chunks
from kvhandoff.cli.harness import on_endpoint_loop
from kvhandoff.protocol import Role

__all__ = ["call_on", "raw_write", "raw_contiguous", "transfer_timings", "copy_bench", "progressing", "gen_entries"]

#: The protocol's default chunk window: the raw WRITEs keep as many in flight.
_WINDOW = 4
#: `progressing`'s tasks, in the GEN rank's process, until each is done.
_TASKS: set[asyncio.Task[None]] = set()


async def call_on(rank: Any, fn: Any, *args: Any) -> Any:
    """Run ``fn(endpoint, *args)`` on `rank`'s endpoint, on its own loop."""
    return await rank.__ray_call__.remote(on_endpoint_loop, fn, *args)


def _write(transport: NixlTransport, streams: list[tuple[str, list[Any], Any]]) -> None:
    """Post each stream's works (name, works, prepared lists) with `_WINDOW`
    in flight per stream, all at once; poll each chunk to DONE and release
    it. The caller's loop waits meanwhile: nothing else of the rank runs."""
    pending = [(name, list(works), prepared) for name, works, prepared in streams]
    posted: list[list[Chunk]] = [[] for _ in pending]
    while any(works for _, works, _ in pending) or any(posted):
        for (name, works, prepared), flying in zip(pending, posted):
            while works and len(flying) < _WINDOW:
                flying.append(NixlTransport.post(transport, name, works.pop(0), prepared=prepared))
            for chunk in list(flying):
                if chunk.poll() in (XferState.DONE, XferState.ERR):
                    if chunk.state is XferState.ERR:
                        raise RuntimeError("raw NIXL WRITE failed")
                    chunk.release()
                    flying.remove(chunk)


def raw_write(
    core: Any,
    edges: list[tuple[Any, list[int], list[int]]],
    chunk_bytes: int | None = None,
    prepared: bool | None = None,
) -> tuple[int, float]:
    """A raw NIXL WRITE of the CTX rank's blocks into GEN ranks, one per
    edge (the GEN rank's directory entry, our blocks, its blocks), all edges
    at once, with exactly the regions a handoff would use and no protocol.
    Returns (bytes, seconds from first post to last DONE)."""
    chunk_bytes = chunk_bytes or core.config.chunk_bytes
    use_prepared = core.config.prepared_descriptors if prepared is None else prepared
    streams = []
    nbytes = 0
    for entry, blocks, gen_blocks in edges:
        (endpoint, name, metadata, geometry), _ = entry
        core._learn_agent(name, metadata, geometry)
        for b, g in zip(blocks, gen_blocks):  # in both pools (DataPlaneError)
            core.buffer.block_addr(b), geometry.block_addr(g)
        pieces = core._edge_pieces((core.config.rank, endpoint.ns.rank), chunk_bytes)
        pairs = list(zip(blocks, gen_blocks))
        chunks = plan_chunks(pieces, pairs, chunk_bytes, core.buffer.region_table(), geometry.region_table())
        lists = core.transport.prepare(name, pieces, geometry) if use_prepared else None
        streams.append((name, list(chunks), lists))
        nbytes += sum(c.nbytes for c in chunks)
    start = time.perf_counter()
    _write(core.transport, streams)
    return nbytes, time.perf_counter() - start


def raw_contiguous(core: Any, entry: Any, nbytes: int, offset: int, chunk_bytes: int | None = None) -> tuple[int, float]:
    """A raw NIXL WRITE of `nbytes` contiguous bytes of the CTX rank's region
    0 into the GEN rank's region 0 at `offset`, in chunks of `chunk_bytes`:
    the link's ceiling for the bytes a handoff moves in pieces. Returns
    (bytes, seconds)."""
    (_, name, metadata, geometry), _ = entry
    core._learn_agent(name, metadata, geometry)
    chunk_bytes = chunk_bytes or core.config.chunk_bytes
    ours, theirs = core.buffer.region_table()[0], geometry.region_table()[0]
    if nbytes > core.buffer.strides[0] * core.buffer.num_blocks or offset + nbytes > theirs[1] * geometry.num_blocks:
        raise DataPlaneError(f"{nbytes} B at {offset} do not fit both pools")
    works = [
        [(ours[0] + o, theirs[0] + offset + o, min(chunk_bytes, nbytes - o))]
        for o in range(0, nbytes, chunk_bytes)
    ]
    start = time.perf_counter()
    _write(core.transport, [(name, works, None)])
    return nbytes, time.perf_counter() - start


def transfer_timings(core: Any) -> list[tuple[str, float, int]]:
    """(request id, seconds from first post to last DONE, bytes) of the CTX
    rank's recent parents."""
    return [(p.request_id, t[1] - t[0], int(t[2])) for p, t in core.xfer.items() if t[1] > 0]


def copy_bench(core: Any, nbytes: int, repeats: int = 3) -> float:
    """Best seconds of a plain in-process copy of `nbytes` (the physical ceiling)."""
    tensor = core.buffer.tensor
    n = min(nbytes, tensor.numel() // 2)  # within region 0
    src, dst = tensor[:n], tensor[n : 2 * n]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return float(best * (nbytes / n))


def _keep_sweeping(core: Any, seconds: float) -> float:
    """On a GEN rank's loop: wake its poll loop at its short interval for
    `seconds` (each wake is one sweep, which progresses the NIXL worker)."""

    async def wake() -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            core._wake.set()
            await asyncio.sleep(core.config.poll_interval_s)

    core._ensure_polling()
    task = asyncio.get_running_loop().create_task(wake())
    _TASKS.add(task)  # kept until done
    task.add_done_callback(_TASKS.discard)
    return seconds


async def progressing(dep: Any, seconds: float) -> None:
    """Every GEN rank of `dep` progresses its NIXL worker for `seconds` (the
    raw baselines' WRITEs target an idle GEN rank)."""
    gens = await dep.ranks(Role.GEN)
    await asyncio.gather(*(call_on(h, _keep_sweeping, seconds) for h in gens))


async def gen_entries(dep: Any) -> list[Any]:
    """The directory entry of every GEN rank of `dep` (what the raw WRITEs target)."""
    spec = dep.gen_spec
    return list(await asyncio.gather(*(dep._directory.lookup.remote(spec.instance_id, g) for g in range(spec.tp))))
