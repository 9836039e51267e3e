"""`kvhandoff bench`: the benchmarks of docs/design.md "Performance targets", as ratios.

Theory of operation
-------------------
Every target is a *ratio* measured in one run, on the same buffers, against a
baseline that needs no protocol, so the numbers mean something on any machine
(a loaded 2-core CPU box or the H200 machine):

1. **data** (>= 64 MiB handoffs): (a) end to end through the full protocol
   (`HandoffResult.latency_s`: admission rounds -> OPEN -> decide -> READY ->
   chunked WRITEs -> TERMINAL -> RECEIPT -> completion round: decode-ready),
   (b) the protocol's data phase of that same handoff (CTX rank's first chunk
   post -> last DONE, `transfer_timings`), (c) a raw NIXL WRITE of the same
   bytes with the same descriptors, agent, buffers and chunk window
   (`raw_write`), (d) a plain in-process copy (`copy_bench`; both in
   kvhandoff.cli._baselines, run inside the CTX rank actor), the physical
   ceiling). The raw WRITE uses the blocks the handoff leased: a fresh
   `BlockPool` hands blocks out FIFO and every lease is released before the
   next handoff, so `_PoolMirror` predicts them exactly.
2. **paged**: raw NIXL with paged block descriptors (every other block, so no
   two descriptors merge) at several block sizes vs the plain copy; and the
   same WRITEs posted from prepared descriptor lists (the default, indices into
   lists NIXL prepared once) vs descriptors built per chunk (`initialize_xfer`).
3. **control**: small-handoff latency p50/p99 vs one Ray actor round trip, and
   sustained handoffs/s with K concurrent clients vs Ray's pipelined
   single-actor call rate.
4. **cancel**: in-flight handoffs cancelled after a random delay: cancel ->
   every rank released (the handoff call returns) and cancel -> every pool back
   to all-free, vs one chunk time + one agreement round.

Within a repeat the measured variants run in an order rotated by the repeat
index, so warm caches and background load do not favour one variant. Each
variant reports best-of-N (the headline, as usual for a ceiling) and the
median over the N repeats; percentiles are nearest-rank over all samples.

Two deployments serve the default run (each launch costs ~15 s on the 2-core
box): one with 2 MiB blocks (data, cancel) and one with 16 KiB blocks (control,
paged). The paged sizes on the shared deployment are runs of k adjacent 16 KiB
blocks with a gap after each run: `ShardMap.descriptor_regions` merges adjacent
blocks, so NIXL receives exactly the descriptors a layout with k x 16 KiB
blocks would give (the table prints the descriptor count and length it
computed). `--paged-layouts per-size` instead launches one deployment per block
size whose KVLayout block is that size.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
import ray

from kvhandoff.actors._stager import STAGED_BELOW, staged_min_descriptors
from kvhandoff.actors._trace import hop_summary
from kvhandoff.actors.deployment import Deployment, HandoffResult
from kvhandoff.cli._baselines import (
    call_on,
    copy_bench,
    gen_entries,
    progressing,
    raw_contiguous,
    raw_write,
    transfer_timings,
)
from kvhandoff.cli._console import Reporter
from kvhandoff.cli._flags import SECTIONS, launch_options
from kvhandoff.cli.harness import on_endpoint_loop
from kvhandoff.protocol import Role
from kvhandoff.topology import KVLayout, block_bytes, memory_pieces, shard_map

__all__ = ["run", "DATA_LAYOUT", "PAGE_LAYOUT"]

KiB = 1 << 10
MiB = 1 << 20

#: Data-plane layout: 8 layers x (K, V) x 8 KV heads x 64 tokens x 128 fp16 dims
#: = 2 MiB per block at TP=1 (large blocks: the data plane's best case).
DATA_LAYOUT = KVLayout(
    num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=64
)
#: Small-handoff / paged layout: one layer's page of 4 tokens = 16 KiB per block
#: at TP=1 (a real per-layer KV page size). 16 tokens = 4 blocks = 64 KiB.
PAGE_LAYOUT = KVLayout(
    num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=4
)


#: Big-request layout: 64-byte blocks (one token of one 16-dim head), so an
#: 8,192-block request moves 512 KiB and its time is the control plane's.
BLOCKS_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", tokens_per_block=1)


class _LaunchFailed(RuntimeError):
    """A deployment did not come up: reported in one line, exit status 2."""


# -- statistics ---------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no samples."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _summary(seconds: Sequence[float], nbytes: int | None = None) -> dict[str, Any]:
    """best / median seconds (and GB/s for `nbytes`) of one variant's samples."""
    if not seconds:
        return {"n": 0}
    best, median = min(seconds), statistics.median(seconds)
    out: dict[str, Any] = {"n": len(seconds), "best_s": best, "median_s": median}
    if nbytes:
        out["best_gbps"] = nbytes / best / 1e9
        out["median_gbps"] = nbytes / median / 1e9
    return out


def _ratio(fast: float, slow: float) -> float:
    """Throughput ratio of the variant timed `slow` to the one timed `fast` (1.0 = parity)."""
    return fast / slow if slow > 0 and not math.isnan(slow) else math.nan


def _rotated(items: Sequence[str], k: int) -> list[str]:
    k %= len(items)
    return [*items[k:], *items[:k]]


class _PoolMirror:
    """The blocks a fresh `BlockPool` leases next when every lease is released
    before the following one: the free list is FIFO (lease pops from the front,
    release appends in lease order), so sequential handoffs rotate it. Both CTX
    and GEN pools see the same sequence, so one mirror predicts both."""

    def __init__(self, num_blocks: int) -> None:
        self._free = collections.deque(range(num_blocks))

    def peek(self, n: int) -> list[int]:
        return list(itertools.islice(self._free, n))

    def cycle(self, n: int) -> list[int]:
        blocks = self.peek(n)
        self._free.rotate(-n)
        return blocks


class _Bench:
    """One benchmark run: shared state (request ids, results) across sections."""

    def __init__(self, args: argparse.Namespace, reporter: Reporter) -> None:
        self.args = args
        self.reporter = reporter
        self._ids = itertools.count()
        self.results: dict[str, Any] = {}
        self.notes: list[str] = []
        self.rng = random.Random(args.seed)
        self.started = time.perf_counter()
        self.pool_samples: list[dict[str, Any]] = []  # `--plot`: pool occupancy over time

    def rid(self, tag: str) -> str:
        return f"bench-{tag}-{next(self._ids)}"

    async def launch(self, layout: KVLayout, pool_blocks: int, *, tp1: bool = False, tp2: bool = False) -> Deployment:
        a = self.args
        ctx_tp, gen_tp = (2 if tp2 else 1 if tp1 else a.ctx_tp), (1 if tp1 or tp2 else a.gen_tp)
        launching = (
            f"launching CTX tp={ctx_tp} -> GEN tp={gen_tp} "
            f"({block_bytes(layout, 1) // KiB} KiB blocks, {a.memory})"
        )
        try:
            with self.reporter.step(launching, done="ranks ready"):
                return await Deployment.launch(
                    ctx_tp=ctx_tp,
                    gen_tp=gen_tp,
                    data_mode="staged" if tp2 else a.data_mode,
                    staging_window=a.staging_window,
                    staging_slot_bytes=a.staging_slot_mib * MiB,
                    layout=layout,
                    pool_blocks=pool_blocks,
                    chunk_bytes=a.chunk_mib * MiB,
                    **launch_options(a),
                    admit_at_open=False if getattr(a, "admit_in_rounds", False) else None,
                    synthetic=False,  # time the protocol and the data plane, not the test pattern
                )
        except Exception as exc:  # InvalidConfig, LaunchFailed: one line, no traceback
            raise _LaunchFailed(f"{type(exc).__name__}: {exc}") from exc

    # -- 1. data plane ------------------------------------------------------------------

    async def data_plane(self, dep: Deployment) -> list[dict[str, Any]]:
        a = self.args
        ctx = await dep.ranks(Role.CTX)
        await progressing(dep, 3600.0)
        smap = shard_map(dep.layout, a.ctx_tp, a.gen_tp)
        full = block_bytes(dep.layout, 1)
        mirror = _PoolMirror(self._data_pool_blocks())
        sizes = [(mib, -(-mib * MiB // full)) for mib in a.sizes_mib]  # (MiB, blocks per rank)
        samples: dict[int, dict[str, list[float]]] = {
            mib: {"e2e": [], "data": [], "raw": [], "copy": [], "control": []} for mib, _ in sizes
        }
        pings: list[float] = []  # Ray round trips to a CTX rank, between the handoffs
        failures: collections.Counter[str] = collections.Counter()

        async def handoff(mib: int, n: int) -> list[int]:
            blocks = mirror.cycle(n)
            request = self.rid(f"data{mib}")
            result = await _handoff(dep, request, n * dep.layout.tokens_per_block, timeout=60.0)
            if result.outcome != "completed":
                failures[result.outcome] += 1
                return blocks
            samples[mib]["e2e"].append(result.latency_s)
            timings = await asyncio.gather(*(call_on(h, transfer_timings) for h in ctx))
            mine = [(s, b) for per_rank in timings for r, s, b in per_rank if r == request]
            if mine and sum(b for _, b in mine) == n * full:
                # CTX ranks write in parallel: the data phase ends with the slowest.
                data_s = max(s for s, _ in mine)
                samples[mib]["data"].append(data_s)
                # What the control plane adds to this handoff: end to end less its data phase.
                samples[mib]["control"].append(result.latency_s - data_s)
            else:
                failures["data_phase_missing"] += 1
            for _ in range(3):
                start = time.perf_counter()
                await ctx[0].ping.remote()
                pings.append(time.perf_counter() - start)
            return blocks

        entries = await gen_entries(dep)

        async def raw(blocks: list[int]) -> tuple[int, float]:
            calls = [
                call_on(
                    ctx[r], raw_write, [(entries[g], blocks, blocks) for _, g in smap.edges_for_ctx_rank(r)],
                    a.chunk_mib * MiB,
                )
                for r in range(a.ctx_tp)
            ]
            done = await asyncio.gather(*calls)
            return sum(b for b, _ in done), max(s for _, s in done)

        async def copy(mib: int) -> float:
            per_rank = mib * MiB // a.ctx_tp  # every CTX rank copies its share at once
            return max(await asyncio.gather(*(call_on(h, copy_bench, per_rank, 1) for h in ctx)))

        # Warm-up: NIXL connections, descriptor caches, page faults.
        for mib, n in sizes:
            await raw(await handoff(mib, n))
            await copy(mib)
        for samples_of in samples.values():
            for kept in samples_of.values():
                kept.clear()
        pings.clear()
        failures.clear()

        for rep in range(a.repeats):
            for mib, n in sizes:
                used: list[int] | None = None
                for variant in _rotated(("handoff", "raw", "copy"), rep):
                    if variant == "handoff":
                        used = await handoff(mib, n)
                    elif variant == "raw":
                        # The blocks this repeat's handoff leases (or leased).
                        nbytes, seconds = await raw(used if used is not None else mirror.peek(n))
                        if nbytes != n * full:
                            failures["raw_bytes_mismatch"] += 1
                        samples[mib]["raw"].append(seconds)
                    else:
                        samples[mib]["copy"].append(await copy(mib))
            self.reporter.line(f"data: repeat {rep + 1}/{a.repeats} done")

        rows = []
        for mib, n in sizes:
            nbytes = n * full
            s = samples[mib]
            row: dict[str, Any] = {"size_mib": mib, "bytes": nbytes, "blocks": n}
            for key in ("e2e", "data", "raw", "copy"):
                row[key] = _summary(s[key], nbytes)
            for which in ("best_s", "median_s"):
                tag = which.split("_")[0]
                raw_s = row["raw"].get(which, math.nan)
                row[f"data_over_raw_{tag}"] = _ratio(raw_s, row["data"].get(which, math.nan))
                row[f"e2e_over_raw_{tag}"] = _ratio(raw_s, row["e2e"].get(which, math.nan))
                row[f"raw_over_copy_{tag}"] = _ratio(row["copy"].get(which, math.nan), raw_s)
            ping_p50 = _pct(pings, 0.5)
            row["control_overhead"] = {
                "n": len(s["control"]), "p50_s": _pct(s["control"], 0.5), "ping_p50_s": ping_p50,
            }
            row["control_overhead_over_ping_p50"] = _pct(s["control"], 0.5) / ping_p50 if pings else math.nan
            rows.append(row)
        if failures:
            self.notes.append(f"data: non-completed samples {dict(failures)}")
        return rows

    def _data_pool_blocks(self) -> int:
        full = block_bytes(DATA_LAYOUT, 1)
        largest = max(-(-mib * MiB // full) for mib in self.args.sizes_mib)
        smallest = min(-(-mib * MiB // full) for mib in self.args.sizes_mib)
        # Spare handoffs' worth of blocks, so a cancel trial that leaks its lease
        # does not starve the trials after it (see cancel_to_release).
        spare = (
            smallest * min(self.args.cancel_spare, self.args.cancels)
            if "cancel" in self.args.sections
            else 0
        )
        return largest + spare

    # -- 2. paged descriptors ------------------------------------------------------------

    async def paged_shared(self, dep: Deployment) -> list[dict[str, Any]]:
        """Runs of k adjacent blocks = one descriptor of k blocks (they merge)."""
        ctx = (await dep.ranks(Role.CTX))[0]
        smap = shard_map(dep.layout, 1, 1)
        await progressing(dep, 3600.0)
        (entry,) = await gen_entries(dep)
        rows = []
        for kib in self.args.paged_kib:
            k = kib * KiB // smap.ctx_block_bytes
            if k < 1 or k * smap.ctx_block_bytes != kib * KiB:
                self.notes.append(
                    f"paged: {kib} KiB is not a multiple of the {smap.ctx_block_bytes} B block"
                )
                continue
            rows.append(await self._paged_one(ctx, entry, smap, kib, k))
        return rows

    async def paged_per_size(self) -> list[dict[str, Any]]:
        """One deployment per block size, whose layout block is that size (tp=1)."""
        rows = []
        token_bytes = block_bytes(PAGE_LAYOUT, 1) // PAGE_LAYOUT.tokens_per_block
        for kib in self.args.paged_kib:
            tokens = kib * KiB // token_bytes
            if tokens < 1 or tokens * token_bytes != kib * KiB:
                self.notes.append(
                    f"paged: {kib} KiB is not a multiple of {token_bytes} B per token"
                )
                continue
            layout = msgspec.structs.replace(PAGE_LAYOUT, tokens_per_block=tokens)
            dep = await self.launch(layout, 2 * self.args.paged_mib * MiB // (kib * KiB), tp1=True)
            try:
                ctx = (await dep.ranks(Role.CTX))[0]
                await progressing(dep, 3600.0)
                (entry,) = await gen_entries(dep)
                rows.append(await self._paged_one(ctx, entry, shard_map(layout, 1, 1), kib, 1))
            finally:
                await dep.shutdown()
        return rows

    async def _paged_one(self, ctx: Any, entry: Any, smap: Any, kib: int, k: int) -> dict[str, Any]:
        a = self.args
        total = a.paged_mib * MiB
        runs = total // (kib * KiB)
        # Every other run of k blocks: no two runs are adjacent, so none merge.
        blocks = [2 * k * run + j for run in range(runs) for j in range(k)]
        bb = smap.ctx_block_bytes
        regions = smap.descriptor_regions((0, 0), [(b * bb, b * bb) for b in blocks])
        nbytes = sum(n for _, _, n in regions)
        lengths = {n for _, _, n in regions}
        edges = [(entry, blocks, blocks)]
        await call_on(ctx, raw_write, edges, a.chunk_mib * MiB)  # warm-up
        raw_s: list[float] = []
        copy_s: list[float] = []
        built_s: list[float] = []
        await call_on(ctx, raw_write, edges, a.chunk_mib * MiB, False)  # warm-up
        for rep in range(a.repeats):
            for variant in _rotated(("raw", "copy", "built"), rep):
                if variant == "built":  # descriptors built per chunk, not prepared
                    moved, seconds = await call_on(ctx, raw_write, edges, a.chunk_mib * MiB, False)
                    built_s.append(seconds)
                elif variant == "raw":
                    moved, seconds = await call_on(ctx, raw_write, edges, a.chunk_mib * MiB)
                    if moved != nbytes:
                        self.notes.append(
                            f"paged {kib} KiB: raw moved {moved} B, expected {nbytes}"
                        )
                    raw_s.append(seconds)
                else:
                    copy_s.append(await call_on(ctx, copy_bench, nbytes, 1))
        row: dict[str, Any] = {
            "block_kib": kib,
            "descriptors": len(regions),
            "descriptor_bytes": sorted(lengths),
            "bytes": nbytes,
            "raw": _summary(raw_s, nbytes),
            "raw_built": _summary(built_s, nbytes),
            "copy": _summary(copy_s, nbytes),
        }
        row["prepared_over_built_best"] = _ratio(min(built_s), min(raw_s))
        row["prepared_over_built_median"] = _ratio(
            statistics.median(built_s), statistics.median(raw_s)
        )
        row["raw_over_copy_best"] = _ratio(min(copy_s), min(raw_s))
        row["raw_over_copy_median"] = _ratio(statistics.median(copy_s), statistics.median(raw_s))
        return row

    async def paged_tp2(self) -> list[dict[str, Any]]:
        """Per piece size: one CTX TP=2 -> GEN TP=1 deployment (blocked
        memory) whose layout makes every shard piece that size (a CTX rank
        holds half the heads: per layer and K/V one piece, never contiguous
        with the next one on the GEN side), in the staged data mode. Each
        repeat times, rotated: `raw` (raw NIXL WRITEs of exactly the
        handoff's pieces, one descriptor each, no protocol), `direct` and
        `staged` (handoffs, data phase: first post to last DONE/scatter, the
        slowest CTX rank), `contiguous` (one raw WRITE region per chunk of
        the same bytes) and `copy` (a plain in-process copy)."""
        rows = []
        for kib in self.args.paged_kib:
            layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=kib)
            smap = shard_map(layout, 2, 1)
            sizes = {seg[-1] for e in smap.edges for seg in memory_pieces(smap, e, "blocked", "blocked")}
            if sizes != {kib * KiB}:
                self.notes.append(f"paged tp2: {kib} KiB layout has pieces of {sorted(sizes)} B")
            gen_block = block_bytes(layout, 1)
            blocks = max(1, self.args.paged_mib * MiB // gen_block)
            dep = await self.launch(layout, 2 * blocks + 2, tp2=True)
            try:
                rows.append(await self._paged_tp2_one(dep, kib, blocks))
                self.reporter.line(f"paged: {kib} KiB pieces done")
            except Exception as exc:  # one size failing does not lose the others
                self.notes.append(f"paged tp2 {kib} KiB failed: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                await dep.shutdown()
        return rows

    async def _paged_tp2_one(self, dep: Deployment, kib: int, blocks: int) -> dict[str, Any]:
        a = self.args
        layout = dep.layout
        ctx = await dep.ranks(Role.CTX)
        await progressing(dep, 3600.0)
        (entry,) = await gen_entries(dep)
        smap = shard_map(layout, 2, 1)
        nbytes = blocks * block_bytes(layout, 1)
        half = nbytes // 2
        pieces = [len(memory_pieces(smap, e, "blocked", "blocked")) for e in smap.edges]
        failures: collections.Counter[str] = collections.Counter()
        samples: dict[str, list[float]] = {k: [] for k in ("raw", "direct", "staged", "contiguous", "copy")}
        counts: dict[str, collections.Counter[str]] = {"direct": collections.Counter(), "staged": collections.Counter()}

        async def handoff(mode: str) -> float | None:
            await asyncio.gather(*(h.__ray_call__.remote(on_endpoint_loop, _set_data_mode, mode) for h in ctx))
            before = await asyncio.gather(*(h.stats.remote() for h in ctx))
            request = self.rid(f"tp2-{mode}-{kib}")
            result = await _handoff(dep, request, blocks * layout.tokens_per_block, timeout=120.0)
            if result.outcome != "completed":
                failures[f"{mode}:{result.outcome}"] += 1
                return None
            after = await asyncio.gather(*(h.stats.remote() for h in ctx))
            for b, x in zip(before, after):
                for key in ("posts_prepared", "posts_built"):
                    counts[mode]["direct_posts"] += x["counters"].get(key, 0) - b["counters"].get(key, 0)
                sc = x["staging"].get("counters", {}).get("staged_chunks", 0)
                counts[mode]["staged_posts"] += sc - b["staging"].get("counters", {}).get("staged_chunks", 0)
            timings = await asyncio.gather(*(call_on(h, transfer_timings) for h in ctx))
            mine = [(sec, b) for per_rank in timings for r, sec, b in per_rank if r == request]
            if not mine or sum(b for _, b in mine) != nbytes:
                failures[f"{mode}:data_phase_missing"] += 1
                return None
            return max(sec for sec, _ in mine)

        async def raw() -> float:
            blocks_ = list(range(blocks))
            done = await asyncio.gather(
                *(call_on(h, raw_write, [(entry, blocks_, blocks_)], a.chunk_mib * MiB) for h in ctx)
            )
            if sum(b for b, _ in done) != nbytes:
                failures["raw_bytes_mismatch"] += 1
            return max(sec for _, sec in done)

        async def contiguous() -> float:
            done = await asyncio.gather(
                *(call_on(h, raw_contiguous, entry, half, r * half, a.chunk_mib * MiB) for r, h in enumerate(ctx))
            )
            return max(sec for _, sec in done)

        async def copy() -> float:
            return max(await asyncio.gather(*(call_on(h, copy_bench, half, 1) for h in ctx)))

        variants: dict[str, Callable[[], Awaitable[float | None]]] = {
            "raw": raw, "direct": lambda: handoff("direct"), "staged": lambda: handoff("staged"),
            "contiguous": contiguous, "copy": copy,
        }
        for fn in variants.values():  # warm-up: connections, caches, page faults
            await fn()
        failures.clear()
        for c in counts.values():
            c.clear()
        for rep in range(a.repeats):
            for name in _rotated(list(variants), rep):
                seconds = await variants[name]()
                if seconds is not None:
                    samples[name].append(seconds)
        stats = await dep.stats()
        row: dict[str, Any] = {
            "block_kib": kib,
            "staging": [
                {"role": st["role"], "rank": st["rank"], **{k: st["staging"].get(k) for k in ("seconds", "counters", "slots")}}
                for st in stats["ranks"]
                if "error" not in st
            ],
            "piece_bytes": kib * KiB,
            "pieces_per_block": pieces,
            "descriptors": sum(pieces) * blocks,
            "bytes": nbytes,
            "posts": {mode: dict(c) for mode, c in counts.items()},
        }
        for name, secs in samples.items():
            row[name] = _summary(secs, nbytes)
        for tag, pick in (("best", min), ("median", statistics.median)):
            t = {k: pick(v) if v else math.nan for k, v in samples.items()}
            row[f"staged_over_direct_{tag}"] = _ratio(t["direct"], t["staged"])
            row[f"staged_over_raw_{tag}"] = _ratio(t["raw"], t["staged"])
            row[f"staged_over_contiguous_{tag}"] = _ratio(t["contiguous"], t["staged"])
            row[f"direct_over_contiguous_{tag}"] = _ratio(t["contiguous"], t["direct"])
            row[f"raw_over_copy_{tag}"] = _ratio(t["copy"], t["raw"])
        below = STAGED_BELOW["cuda" if a.memory == "VRAM" else "cpu"]
        row["auto_mode"] = "staged" if kib * KiB < below else "direct"
        row["auto_over_contiguous_best"] = row[f"{row['auto_mode']}_over_contiguous_best"] if row["auto_mode"] == "staged" else row["direct_over_contiguous_best"]
        if a.memory != "VRAM":
            _host_staged_ceiling(row)
        if failures:
            self.notes.append(f"paged tp2 {kib} KiB: {dict(failures)}")
        return row

    async def crossover(self) -> dict[str, Any]:
        """Staged against direct by request size, at one piece size: where
        staging's fixed cost per chunk (a gather, a notice, a scatter, an ACK)
        stops outweighing the per-descriptor cost it saves. One CTX TP=2 ->
        GEN TP=1 deployment (the paged tp2 layout: 4 pieces per block and CTX
        rank); per request size, handoffs alternate direct and staged and each
        is timed by its data phase (first post to last chunk reported, the
        slower CTX rank). `min_descriptors`: the smallest edge from which
        staged is faster (median) at that size and at every larger one."""
        a = self.args
        kib = a.crossover_kib
        layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16", tokens_per_block=kib)
        sizes = sorted(set(a.crossover_blocks))
        per_block = len(memory_pieces(shard_map(layout, 2, 1), (0, 0), "blocked", "blocked"))
        dep = await self.launch(layout, 2 * sizes[-1] + 2, tp2=True)
        rows: list[dict[str, Any]] = []
        try:
            ctx = await dep.ranks(Role.CTX)
            await progressing(dep, 3600.0)

            async def one(mode: str, blocks: int) -> float | None:
                await asyncio.gather(*(h.__ray_call__.remote(on_endpoint_loop, _set_data_mode, mode) for h in ctx))
                request = self.rid(f"xo-{mode}-{blocks}")
                result = await _handoff(dep, request, blocks * kib, timeout=60.0)
                if result.outcome != "completed":
                    self.notes.append(f"crossover {blocks} blocks {mode}: {result.outcome}")
                    return None
                timings = await asyncio.gather(*(call_on(h, transfer_timings) for h in ctx))
                mine = [sec for per in timings for r, sec, _ in per if r == request]
                return max(mine) if mine else None

            for blocks in sizes:
                samples: dict[str, list[float]] = {"direct": [], "staged": []}
                for mode in ("direct", "staged"):  # warm-up: maps, connections
                    await one(mode, blocks)
                for rep in range(a.repeats):
                    for mode in _rotated(["direct", "staged"], rep):
                        sec = await one(mode, blocks)
                        if sec is not None:
                            samples[mode].append(sec)
                row: dict[str, Any] = {"blocks": blocks, "descriptors": blocks * per_block, "bytes": blocks * per_block * kib * KiB}
                for mode, secs in samples.items():
                    row[mode] = _summary(secs)
                row["staged_over_direct_median"] = _ratio(row["direct"].get("median_s", math.nan), row["staged"].get("median_s", math.nan))
                row["staged_over_direct_best"] = _ratio(row["direct"].get("best_s", math.nan), row["staged"].get("best_s", math.nan))
                rows.append(row)
                self.reporter.line(f"crossover: {blocks} blocks done")
        finally:
            await dep.shutdown()
        device = "cuda" if a.memory == "VRAM" else "cpu"
        least = staged_min_descriptors(device)
        for row in rows:
            small = kib * KiB < STAGED_BELOW[device]
            row["auto_mode"] = "staged" if small and row["descriptors"] >= least else "direct"
        wins = [r["staged_over_direct_median"] > 1.0 for r in rows]
        first = next((i for i in range(len(rows)) if all(wins[i:])), None)
        return {
            "piece_kib": kib,
            "rows": rows,
            "min_descriptors": rows[first]["descriptors"] if first is not None else None,
            "staged_min_descriptors": least,
        }

    # -- 3. control plane ----------------------------------------------------------------

    async def control_plane(self, dep: Deployment) -> dict[str, Any]:
        a = self.args
        ctx = (await dep.ranks(Role.CTX))[0]
        failures: collections.Counter[str] = collections.Counter()

        async def small() -> float | None:
            result = await _handoff(dep, self.rid("small"), a.small_tokens, timeout=30.0)
            if result.outcome != "completed":
                failures[result.outcome] += 1
                return None
            return result.latency_s

        async def ping() -> float:
            start = time.perf_counter()
            await ctx.ping.remote()
            return time.perf_counter() - start

        async def pipelined() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(ctx.ping.remote() for _ in range(a.ping_n)))
            return a.ping_n / (time.perf_counter() - start)

        for _ in range(3):  # warm-up
            await small()
            await ping()
        await pipelined()
        failures.clear()

        latencies: list[float] = []
        pings: list[float] = []
        calls_before = await _call_counts(dep)
        for i in range(a.small_n):
            for variant in _rotated(("handoff", "ping"), i):
                if variant == "handoff":
                    seconds = await small()
                    if seconds is not None:
                        latencies.append(seconds)
                else:
                    pings.extend([await ping() for _ in range(3)])

        calls = _per_handoff(calls_before, await _call_counts(dep), a.small_n)
        hops = await self._hops(dep, failures)
        rates: list[float] = [await pipelined()]
        sustained = []
        for k in a.concurrency:
            sustained.append(await self._sustain(dep, k, failures))
            rates.append(await pipelined())  # interleaved with the handoff rates
        ray_rate = max(rates)
        best = max((s["handoffs_per_s"] for s in sustained), default=math.nan)
        if failures:
            self.notes.append(f"control: non-completed handoffs {dict(failures)}")
        return {
            "small_tokens": a.small_tokens,
            "small_bytes": -(-a.small_tokens // dep.layout.tokens_per_block)
            * block_bytes(dep.layout, 1),
            "latency": {
                "n": len(latencies),
                "samples_s": latencies,
                "p50_s": _pct(latencies, 0.5),
                "p99_s": _pct(latencies, 0.99),
                "max_s": max(latencies, default=math.nan),
            },
            "ping": {"n": len(pings), "p50_s": _pct(pings, 0.5), "p99_s": _pct(pings, 0.99)},
            "latency_over_ping_p50": _pct(latencies, 0.5) / _pct(pings, 0.5) if pings else math.nan,
            "latency_over_ping_p99": _pct(latencies, 0.99) / _pct(pings, 0.5) if pings else math.nan,
            "per_handoff": calls,
            "hops": hops,
            "ray_pipelined_calls_per_s": {"best": ray_rate, "samples": rates},
            "sustained": sustained,
            "sustained_over_pipelined_best": best / ray_rate,
        }

    async def big_requests(self, dep: Deployment) -> dict[str, Any]:
        """Control time by request size: end to end minus the data phase (CTX
        rank's first post to last DONE), sizes interleaved in a rotated order.
        `over_first_p50`: each size's median control time over the first
        size's (issue 23's target: 8,192 blocks <= 1.5x 128 blocks)."""
        a = self.args
        ctx = (await dep.ranks(Role.CTX))[0]
        sizes = list(a.big_blocks)
        control: dict[int, list[float]] = {n: [] for n in sizes}
        e2e: dict[int, list[float]] = {n: [] for n in sizes}
        failures: collections.Counter[str] = collections.Counter()
        for rep in range(a.big_n + 2):  # two warm-up rounds: maps, connections
            for n in _rotated([str(n) for n in sizes], rep):
                blocks = int(n)
                request = self.rid(f"big{blocks}")
                result = await _handoff(dep, request, blocks * BLOCKS_LAYOUT.tokens_per_block, timeout=60.0)
                if result.outcome != "completed":
                    failures[result.outcome] += 1
                    continue
                timings = await call_on(ctx, transfer_timings)
                data = max((sec for r, sec, _ in timings if r == request), default=math.nan)
                if rep >= 2 and not math.isnan(data):
                    control[blocks].append(result.latency_s - data)
                    e2e[blocks].append(result.latency_s)
        if failures:
            self.notes.append(f"control blocks: non-completed handoffs {dict(failures)}")
        first = _pct(control[sizes[0]], 0.5)
        rows = [
            {
                "blocks": n,
                "n": len(control[n]),
                "control_p50_s": _pct(control[n], 0.5),
                "e2e_p50_s": _pct(e2e[n], 0.5),
                "over_first_p50": _pct(control[n], 0.5) / first,
            }
            for n in sizes
        ]
        return {"block_bytes": block_bytes(BLOCKS_LAYOUT, 1), "rows": rows}

    async def _hops(self, dep: Deployment, failures: collections.Counter[str]) -> dict[str, Any]:
        """The small handoff's hop trace (actors/_trace.py): the same
        handoffs, one at a time, every one traced; its critical path's hops
        and where their time goes. Not part of the latency samples (a traced
        handoff records and is read back)."""
        a = self.args
        await dep.set_trace(1)
        traces = []
        latencies = []
        try:
            for _ in range(max(a.small_n // 2, 10)):
                rid = self.rid("traced")
                result = await _handoff(dep, rid, a.small_tokens, timeout=30.0)
                trace = await dep.trace(rid)
                if result.outcome != "completed" or trace is None:
                    failures[f"traced:{result.outcome}"] += 1
                    continue
                traces.append(trace)
                latencies.append(result.latency_s)
        finally:
            await dep.set_trace(0)
        return {**hop_summary(traces), "traced_latency_p50_s": _pct(latencies, 0.5)}

    async def _sustain(
        self, dep: Deployment, k: int, failures: collections.Counter[str]
    ) -> dict[str, Any]:
        """k clients, each running small handoffs back to back for `--sustain-s`."""
        a = self.args
        deadline = time.perf_counter() + a.sustain_s
        done = 0
        latencies: list[float] = []

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                result = await _handoff(dep, self.rid(f"rate{k}"), a.small_tokens, timeout=30.0)
                if result.outcome == "completed":
                    done += 1
                    latencies.append(result.latency_s)
                else:
                    failures[result.outcome] += 1

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(k)))
        elapsed = time.perf_counter() - start  # includes draining the last in-flight ones
        return {
            "concurrency": k,
            "completed": done,
            "seconds": elapsed,
            "handoffs_per_s": done / elapsed,
            "latency_samples_s": latencies,
            "latency_p50_s": _pct(latencies, 0.5),
            "latency_p99_s": _pct(latencies, 0.99),
        }

    # -- 4. cancel-to-release ------------------------------------------------------------

    def _cancel_tokens(self, dep: Deployment) -> tuple[int, int]:
        """The cancel trials' size: (MiB, tokens) of the smallest `--sizes-mib`."""
        mib = min(self.args.sizes_mib)
        return mib, -(-mib * MiB // block_bytes(dep.layout, 1)) * dep.layout.tokens_per_block

    async def _handoff_median_s(self, dep: Deployment, trials: int) -> float:
        """The median time of `trials` handoffs of the cancel trials' size."""
        _, tokens = self._cancel_tokens(dep)
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            await _handoff(dep, self.rid("size"), tokens, self.args.cancel_timeout_s)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    async def cancel_to_release(self, dep: Deployment, max_delay_s: float) -> dict[str, Any]:
        """Cancel in-flight handoffs after U(0, max_delay) and time the release.

        Two clocks from the moment `cancel` is called: until the handoff call
        returns (every GEN and CTX rank reported its local outcome: released),
        and until every rank's pool is back to the blocks it held before the
        trial (polled through `stats`, so it includes the polls' own round
        trips). A trial whose blocks are not back within `--cancel-timeout-s`
        is counted as *not released* (a leak) and its blocks become the new
        baseline, so later trials are still measured."""
        a = self.args
        mib, tokens = self._cancel_tokens(dep)
        outcomes: collections.Counter[str] = collections.Counter()
        to_return: list[float] = []
        to_free: list[float] = []
        stuck: list[str] = []
        # Nothing is held between handoffs, but a handoff's CTX side releases
        # just after its answer: wait (bounded) for every pool to be whole, so
        # each trial waits for every rank's release, the CTX's included. What
        # is still held after the bound leaked, and stays out of the trials.
        baseline = [0] * len(await _leased(dep))
        if not await _wait_leased(dep, baseline, a.cancel_timeout_s):
            baseline = await _leased(dep)
        for _ in range(a.cancels):
            request = self.rid("cancel")
            task = asyncio.create_task(_handoff(dep, request, tokens, a.cancel_timeout_s))
            await asyncio.sleep(self.rng.uniform(0.0, max_delay_s))
            start = time.perf_counter()
            await dep.cancel(request)
            result = await task
            returned = time.perf_counter() - start
            released = await _wait_leased(dep, baseline, a.cancel_timeout_s)
            freed = time.perf_counter() - start
            outcome = result.outcome
            if not released:
                # Also for a handoff that completed: its CTX side may still never release.
                stuck.append(
                    f"{outcome} ctx={','.join(result.ctx_outcomes)} gen={','.join(result.gen_outcomes)}"
                )
                outcomes[f"{outcome}, not released"] += 1
                baseline = [max(b, x) for b, x in zip(baseline, await _leased(dep))]
                continue
            if outcome == "completed":
                outcomes[outcome] += 1
                continue  # finished before the cancel landed: nothing to release early
            outcomes[outcome] += 1
            to_return.append(returned)
            to_free.append(freed)
        stats = await dep.stats()
        rounds = [c.get("round_s_p50") for c in stats["coordinators"].values()]
        round_s = max((r for r in rounds if r is not None), default=math.nan)
        if stuck:
            self.notes.append(
                f"cancel: {len(stuck)} trial(s) never released their blocks: {stuck[:4]}"
            )
        return {
            "size_mib": mib,
            "cancels": a.cancels,
            "outcomes": dict(outcomes),
            "max_delay_s": max_delay_s,
            "release_s": {
                "n": len(to_return),
                "samples": to_return,
                "p50": _pct(to_return, 0.5),
                "p99": _pct(to_return, 0.99),
            },
            "all_free_s": {
                "n": len(to_free),
                "p50": _pct(to_free, 0.5),
                "p99": _pct(to_free, 0.99),
            },
            "not_released": len(stuck),
            "round_s_p50": round_s,
            "leaked_blocks_per_rank": baseline,
            "quarantined_blocks": sum(r.get("quarantined", 0) for r in stats["ranks"]),
        }

    # -- 5. control frames: one-way Ray calls vs NIXL notifications -------------------

    async def frames(self) -> dict[str, Any]:
        """cli/_frames_bench.py: two actors, no deployment."""
        from kvhandoff.cli._frames_bench import measure

        a = self.args
        return await measure(a.frames_bytes, a.frames_n, a.frames_burst)

    # -- the run ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _pools(self, section: str, dep: Deployment) -> AsyncIterator[None]:
        """With `--plot`: sample every rank's pool (free / leased / quarantined,
        summed per role) every 0.1 s while the section runs, for the occupancy
        plot. Without it, nothing (the stats calls would cost the ranks)."""
        if not self.args.plot:
            yield
            return
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                stats = await dep.stats()
                row: dict[str, Any] = {"t": time.perf_counter() - self.started, "section": section}
                for role in ("ctx", "gen"):
                    ranks = [r for r in stats["ranks"] if r.get("role") == role and "free" in r]
                    for key in ("free", "leased", "quarantined"):
                        row[f"{role}_{key}"] = sum(r[key] for r in ranks)
                self.pool_samples.append(row)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)

        task = asyncio.create_task(sample())
        try:
            yield
        finally:
            stop.set()
            await task

    def _section(self, name: str, what: str) -> contextlib.AbstractContextManager[None]:
        return self.reporter.step(f"{name}: {what}", done=f"{name} done")

    async def run(self) -> dict[str, Any]:
        a = self.args
        sections = set(a.sections.split(","))
        started = time.perf_counter()
        out: dict[str, Any] = {
            "argv": sys.argv[1:],
            "machine": {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "physical_cores": _physical_cores(),
                "loadavg_start": os.getloadavg(),
                "memory": a.memory,
                "ucx_tls": os.environ.get("UCX_TLS"),
                "ray": ray.__version__,
            },
            "config": {
                "ctx_tp": a.ctx_tp,
                "gen_tp": a.gen_tp,
                "repeats": a.repeats,
                "chunk_mib": a.chunk_mib,
                "data_mode": a.data_mode,
                # A one-rank CTX instance admits at the OPEN unless asked otherwise.
                "admit_in_rounds": bool(getattr(a, "admit_in_rounds", False)),
                "staging_window": a.staging_window,
                "staging_slot_mib": a.staging_slot_mib,
                "data_layout_block_bytes": block_bytes(DATA_LAYOUT, 1),
                "page_layout_block_bytes": block_bytes(PAGE_LAYOUT, 1),
            },
        }
        launches: list[float] = []

        async def timed_launch(launch: Callable[[], Awaitable[Deployment]]) -> Deployment:
            t = time.perf_counter()
            dep = await launch()
            launches.append(time.perf_counter() - t)
            if dep.carrier is not None:  # what --control-frames resolved to (auto: measured)
                out["config"]["control_frames"] = dep.carrier.as_dict()
            return dep

        if sections & {"data", "cancel"}:
            dep = await timed_launch(lambda: self.launch(DATA_LAYOUT, self._data_pool_blocks()))
            try:
                max_delay = 0.1
                if "data" in sections:
                    with self._section("data", f"{','.join(map(str, a.sizes_mib))} MiB handoffs"):
                        out["data"] = await self.data_plane(dep)
                    smallest = min(out["data"], key=lambda r: r["size_mib"])
                    max_delay = smallest["e2e"].get("median_s", max_delay)
                    out["chunk_s"] = (
                        a.chunk_mib * MiB / (smallest["raw"].get("median_gbps", math.nan) * 1e9)
                    )
                if "cancel" in sections:
                    with self._section("cancel", f"{a.cancels} cancelled handoffs"):
                        async with self._pools("cancel", dep):
                            if "data" not in sections:
                                # Cancel within a handoff's own time, as after the data section.
                                max_delay = await self._handoff_median_s(dep, 3)
                            out["cancel"] = await self.cancel_to_release(dep, max_delay)
            finally:
                await dep.shutdown()
        if sections & {"paged", "control"}:
            if "paged" in sections and a.paged_layouts == "per-size":
                with self._section("paged", "one deployment per block size"):
                    out["paged"] = await self.paged_per_size()
            if "paged" in sections and a.paged_layouts == "tp2":
                with self._section("paged", "one CTX tp=2 -> GEN tp=1 deployment per piece size"):
                    out["paged"] = await self.paged_tp2()
                out["staged_below"] = {"cpu": STAGED_BELOW["cpu"], "cuda": STAGED_BELOW["cuda"]}
            need_shared = "control" in sections or (
                "paged" in sections and a.paged_layouts == "shared"
            )
            if need_shared:
                pool = max(
                    2 * a.paged_mib * MiB // block_bytes(PAGE_LAYOUT, 1),
                    2 * max(a.concurrency) * 64,
                )
                dep = await timed_launch(lambda: self.launch(PAGE_LAYOUT, pool))
                try:
                    if "paged" in sections and a.paged_layouts == "shared":
                        with self._section("paged", "runs of 16 KiB blocks"):
                            out["paged"] = await self.paged_shared(dep)
                    if "control" in sections:
                        with self._section("control", "small-handoff latency and rate"):
                            async with self._pools("control", dep):
                                out["control"] = await self.control_plane(dep)
                finally:
                    await dep.shutdown()
            if "control" in sections and len(a.big_blocks) > 1:
                pool = 2 * max(a.big_blocks) + 64
                dep = await timed_launch(lambda: self.launch(BLOCKS_LAYOUT, pool, tp1=True))
                try:
                    with self._section("control", f"request sizes {','.join(map(str, a.big_blocks))} blocks"):
                        out["control"]["blocks"] = await self.big_requests(dep)
                finally:
                    await dep.shutdown()
        if "frames" in sections:
            with self._section("frames", "control frames, Ray calls vs NIXL notifications"):
                out["frames"] = await self.frames()
        if "crossover" in sections:
            with self._section("crossover", "staged vs direct by request size (descriptors per edge)"):
                out["crossover"] = await self.crossover()
        if "scale" in sections:
            from kvhandoff.cli._bench_scale import scale

            with self._section("scale", "aggregate handoff rate of NxN fleets vs independent pairs"):
                out["scale"] = await scale(a, self.reporter, self.rid)
        if "engine" in sections:
            from kvhandoff.cli._bench_engine import engine_cost

            with self._section("engine", "the engine's Python beside no endpoint, an idle one, one under load"):
                out["engine"] = await engine_cost(a, self.reporter, self.rid)
        if "soak" in sections:
            from kvhandoff.cli._bench_soak import soak

            with self._section("soak", f"{a.soak_s:.0f} s of handoffs under cancels: does memory stay flat?"):
                out["soak"] = await soak(a, self.reporter, self.rid)
        if self.pool_samples:
            out["pools"] = self.pool_samples
        out["targets"] = _targets(out)
        out["notes"] = self.notes
        out["machine"]["loadavg_end"] = os.getloadavg()
        out["launch_s"] = launches
        out["wall_s"] = time.perf_counter() - started
        return out


def _set_data_mode(core: Any, mode: str) -> str:
    """Bench-only (run on a CTX rank's endpoint loop through Ray's
    __ray_call__): switch its data mode between handoffs."""
    import msgspec

    core.config = msgspec.structs.replace(core.config, data_mode=mode)
    return mode


async def _handoff(
    dep: Deployment, request_id: str, num_tokens: int, timeout: float
) -> HandoffResult:
    """`Deployment.handoff`, with an exception turned into an outcome
    ("raised:<error>"), so one bad trial is counted, not fatal to the run."""
    start = time.perf_counter()
    try:
        return await dep.handoff(request_id, num_tokens, timeout=timeout)
    except Exception as exc:
        name = type(getattr(exc, "cause", None) or exc).__name__
        return HandoffResult(
            request_id=request_id, outcome=f"raised:{name}", latency_s=time.perf_counter() - start
        )


async def _call_counts(dep: Deployment) -> dict[str, int]:
    """Every Ray call and control frame the deployment made so far, per kind:
    the client's, each coordinator's (to its ranks and to its peer), each
    rank's reports and frames (a frame is a one-way actor call). Round calls
    and reports that went on a coordinator's channel instead (actors/_channel.py)
    count as kinds ending in ``_channel``, not as Ray calls."""
    stats = await dep.stats()
    counts: collections.Counter[str] = collections.Counter()
    for kind, n in dep.calls.items():
        if kind != "submit":  # counted by carrier (below)
            counts[f"client_{kind}"] += n
    submits = stats.get("submits") or {}
    counts["client_submit"] += submits.get("submit_calls", 0) + submits.get("submit_batches", 0)
    counts["client_submit_channel"] += submits.get("submit_channel", 0)
    for role, c in stats["coordinators"].items():
        for kind, n in (c.get("calls") or {}).items():
            if kind in ("rank_vote_calls", "rank_apply_calls", "channel_calls"):
                continue  # round calls: counted by carrier (below)
            if kind.endswith("_by_ray"):
                counts[f"{role}_coord_{kind[: -len('_by_ray')]}"] += n
            elif kind.endswith("_by_channel"):
                counts[f"{role}_coord_{kind[: -len('_by_channel')]}_channel"] += n
            elif kind.endswith("_calls"):
                counts[f"{role}_coord_{kind[: -len('_calls')]}"] += n
    for r in stats["ranks"]:
        told = r.get("counters", {}).get("channel_tells", 0)
        for kind, n in r.get("counters", {}).items():
            if kind == "reports_sent":
                counts[f"{r['role']}_reports"] += n - told
                counts[f"{r['role']}_reports_channel"] += told
            elif kind == "frame_calls":
                counts[f"{r['role']}_frame_calls"] += n
            elif kind.startswith("frames_") and kind != "frames_sent":
                counts[f"frame_{kind[len('frames_'):]}"] += n
    return dict(counts)


def _per_handoff(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, Any]:
    """Ray calls and frames per small handoff over `n` sequential ones (the
    counter deltas, by kind)."""
    kinds = sorted(set(before) | set(after))
    delta = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in kinds if after.get(k, 0) != before.get(k, 0)}
    frames = sum(v for k, v in delta.items() if k.startswith("frame_"))
    channel = sum(v for k, v in delta.items() if k.endswith("_channel"))
    # Frames travel grouped: one one-way call per peer and event-loop turn.
    calls = sum(v for k, v in delta.items() if not k.startswith("frame_") and not k.endswith("_channel"))
    return {"handoffs": n, "ray_calls": calls, "channel_messages": channel, "frames": frames, "by_kind": delta}


async def _leased(dep: Deployment) -> list[int]:
    """Leased + quarantined blocks per rank (-1 for a rank that did not answer)."""
    stats = await dep.stats()
    return [r["pool"] - r["free"] if "error" not in r else -1 for r in stats["ranks"]]


async def _wait_leased(dep: Deployment, baseline: list[int], timeout_s: float) -> bool:
    """Poll until every rank holds no more blocks than `baseline` (all free, when
    nothing leaked before)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        now = await _leased(dep)
        if len(now) == len(baseline) and all(0 <= n <= b for n, b in zip(now, baseline)):
            return True
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.002)


# -- targets and rendering -------------------------------------------------------------------


def _host_staged_ceiling(row: dict[str, Any]) -> None:
    """Add to a host-memory paged row the most staged can move there. Every
    hop is CPU work on the same cores: a staged byte is gathered (a copy),
    written (a contiguous WRITE, which UCX does as a copy on the writer's
    core) and scattered (a copy). `copy` and `contiguous` were each measured
    on both CTX ranks at once, so even perfectly overlapped, staged moves at
    most 1 / (2 / copy + 1 / contiguous)."""
    rates = [row.get(k, {}).get("best_gbps") for k in ("copy", "contiguous", "direct")]
    if not all(isinstance(r, float | int) and r > 0 for r in rates):
        return
    copy, contiguous, direct = rates
    row["staged_ceiling_gbps"] = 1 / (2 / copy + 1 / contiguous)
    row["staged_ceiling_over_direct_best"] = row["staged_ceiling_gbps"] / direct


def _targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """docs/design.md "Performance targets", each with the measured value and whether it is met."""
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float, op: str, bound: float, note: str = "", why: str = "") -> None:
        """`why`: what keeps the target out of reach where it is not met
        (printed under the table; the docs have the measurements)."""
        met = (
            None
            if math.isnan(value) or math.isnan(bound)
            else (value >= bound if op == ">=" else value <= bound)
        )
        entry = {"target": name, "value": value, "op": op, "bound": bound, "met": met, "note": note}
        cpus = out.get("machine", {}).get("cpus") or 0
        if "GPU" in note and cpus < 16:  # a GPU machine's bound, measured here for the record
            why = f"the bound is for the machine the note names; this one has {cpus or 'fewer'} CPUs"
        if met is False and why:
            entry["why"] = why
        targets.append(entry)

    for row in out.get("data", []):
        mib = row["size_mib"]
        e2e_s = row.get("e2e", {}).get("best_s", math.nan)
        control_s = row.get("control_overhead", {}).get("p50_s", math.nan)
        add(f"handoff e2e / raw NIXL @ {mib} MiB (best)", row["e2e_over_raw_best"], ">=", 0.95, "",
            f"the control time ({control_s * 1e3:.1f} ms p50: the control overhead row) is "
            f"{control_s / e2e_s:.0%} of the best end to end ({e2e_s * 1e3:.1f} ms) at this size on this machine; "
            "the data phase row compares the transfer alone")
        add(
            f"handoff data phase / raw NIXL @ {mib} MiB (best)",
            row["data_over_raw_best"],
            ">=",
            0.95,
            "diagnostic: first chunk post to last DONE inside the protocol",
            "the data phase posts the request in chunks (--chunk-mib) and polls them from the rank's "
            "event loop, where raw NIXL posts one transfer and spins on it",
        )
        if "control_overhead_over_ping_p50" in row:
            add(f"control overhead (e2e - data phase) p50 @ {mib} MiB / ping p50",
                row["control_overhead_over_ping_p50"], "<=", 2.0,
                "GPU host target" if (out.get("machine", {}).get("cpus") or 0) < 16 else "GPU host")
    cpu = out.get("machine", {}).get("memory") != "VRAM"
    auto: list[float] = []
    for row in out.get("paged", []):
        if "staged" not in row:
            continue
        kib = row["block_kib"]
        if kib in (16, 64):
            add(f"staged handoff / contiguous raw NIXL @ {kib} KiB pieces (best)",
                row["staged_over_contiguous_best"], ">=", 0.75,
                "GPU target (H200x2)" if cpu else "")
        if kib == 16:
            note = "the CPU target, measured here too"
            if cpu and "staged_ceiling_over_direct_best" in row:
                ceiling = row["staged_ceiling_over_direct_best"]
                note = (
                    f"{'out of reach' if ceiling < 1.5 else 'ceiling'} on host memory: two copies and a "
                    f"WRITE per staged byte cap staged at 1/(2/copy + 1/contiguous) = "
                    f"{row['staged_ceiling_gbps']:.2f} GB/s = {ceiling:.2f}x direct in this run"
                )
            elif cpu:
                note = ""
            add("staged handoff / direct handoff @ 16 KiB pieces (best)",
                row["staged_over_direct_best"], ">=", 1.5, note)
        if row["auto_mode"] == "staged":
            auto.append(row["staged_over_direct_best"])
    if auto:
        add("staged / direct where auto stages it, worst piece size (best)", min(auto), ">=", 1.0)
    tp2 = [r["auto_over_contiguous_best"] for r in out.get("paged", []) if "auto_over_contiguous_best" in r]
    if tp2:
        add("TP2->TP1 handoff data phase (auto mode) / contiguous raw, worst piece size (best)",
            min(tp2), ">=", 0.7, "GPU target (H200x2)" if cpu else "")
    for row in out.get("paged", []):
        if row["block_kib"] == 256:
            add(
                "paged raw NIXL / copy @ 256 KiB (best)",
                row["raw_over_copy_best"],
                ">=",
                0.9,
                "target is for the GPU machine",
            )
    crossover = out.get("crossover")
    if crossover:
        staged = [r["staged_over_direct_median"] for r in crossover["rows"] if r["auto_mode"] == "staged"]
        direct = [1 / r["staged_over_direct_median"] for r in crossover["rows"]
                  if r["auto_mode"] == "direct" and r["staged_over_direct_median"] > 0]
        kib = crossover["piece_kib"]
        if staged:
            add(f"staged / direct where auto stages, worst request size @ {kib} KiB pieces (median)", min(staged), ">=", 1.0)
        if direct:
            add(f"direct / staged where auto posts direct, worst request size @ {kib} KiB pieces (median)", min(direct), ">=", 0.8,
                "informational: near the crossover either mode is within noise")
    control = out.get("control")
    if control:
        # The GPU host (16 cores and up) and the 2-core box have their own bounds.
        host = "GPU host" if (out.get("machine", {}).get("cpus") or 0) >= 16 else "2-core box"
        gpu = host == "GPU host"
        add("small handoff p50 / ping p50", control["latency_over_ping_p50"], "<=", 2.0 if gpu else 6.0, host)
        if "latency_over_ping_p99" in control:  # bounded on the GPU host; recorded on the 2-core box
            add("small handoff p99 / ping p50", control["latency_over_ping_p99"], "<=", 4.0, host if gpu else "GPU host target")
        clients = max((r["concurrency"] for r in control.get("sustained", [])), default=1)
        add(
            "sustained handoffs/s / pipelined Ray calls/s",
            control["sustained_over_pipelined_best"],
            ">=",
            1.0 if gpu else 0.5,
            host,
            f"a small handoff costs about {control.get('per_handoff', {}).get('ray_calls', 7):.0f} Ray calls "
            "between processes that share this machine's cores, where the pipelined rate is one call each, "
            "so the cores bound the ratio near 1/calls (docs/benchmarks.md)"
            + ("" if clients >= 8 else f"; with at most {clients} client(s) (--concurrency) nothing is pipelined"),
        )
        hops = control.get("hops", {})
        if "hops_p50" in hops:
            add("hops_p50: sequential actor hops of a small handoff", hops["hops_p50"], "<=", 6.0)
        rows = control.get("blocks", {}).get("rows", [])
        for row in rows[1:]:
            if row["blocks"] == 8192 and rows[0]["blocks"] == 128:
                add("control time p50 of an 8,192-block request / a 128-block one",
                    row["over_first_p50"], "<=", 1.5)
    if out.get("scale"):
        from kvhandoff.cli._bench_scale import scale_targets

        cores = out.get("machine", {}).get("cpus") or 0
        scale_targets(out["scale"], "GPU host target (16 cores)" if cores < 16 else "", add)
    if out.get("engine"):
        from kvhandoff.cli._bench_engine import engine_targets

        engine_targets(out["engine"], add)
    if out.get("soak"):
        from kvhandoff.cli._bench_soak import soak_targets

        soak_targets(out["soak"], add)
    cancel = out.get("cancel")
    if cancel:
        bound = out.get("chunk_s", math.nan) + cancel["round_s_p50"]
        p99 = math.inf if cancel["not_released"] else cancel["release_s"]["p99"]
        note = (
            f"{cancel['not_released']} of {cancel['cancels']} never released"
            if cancel["not_released"]
            else ""
        )
        add("cancel->release p99 (s) vs chunk + round", p99, "<=", bound, note,
            "" if cancel["not_released"] else
            f"the p50 is {cancel['release_s']['p50'] * 1e3:.1f} ms; the p99 of {cancel['release_s']['n']} cancels "
            "is their slowest, and on a machine whose cores every rank, coordinator and client share, "
            "a cancel's rounds wait for the cores as the handoffs do")
    for row in out.get("frames", {}).get("sizes", []):
        info = "informational: which transport control frames should use"
        add(f"frames @ {row['bytes']} B: nixl one-way p50 / ray one-way p50",
            row["nixl_over_ray_one_way_p50"], "<=", 1.0, info)
        add(f"frames @ {row['bytes']} B: nixl burst frames/s / ray burst frames/s",
            row["nixl_over_ray_burst"], ">=", 1.0, info)
    return targets


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _physical_cores() -> int | None:
    """Distinct (package, core) pairs in /proc/cpuinfo: the cores that
    `cpus` counts once each, however many hardware threads each has (None
    where /proc/cpuinfo does not say). Processes on the two threads of one
    core share it: a fleet's scaling is bounded by these, not by `cpus`."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    cores: set[tuple[str, str]] = set()
    package = core = None
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            package = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not line.strip():
            if package is not None and core is not None:
                cores.add((package, core))
            package = core = None
    return len(cores) or None


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "| " + " | ".join("-" * w for w in widths) + " |"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([f"\n{title}", line, rule, *body])


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else seconds * 1e3


def _p50_p99_row(label: str, dist: dict[str, Any], unit: str = "") -> list[Any]:
    """A table row of a distribution of seconds: `label`, its p50 and p99 in
    ms (keys "p50" and "p99", each with `unit` appended) and its count."""
    return [label, _ms(dist["p50" + unit]), _ms(dist["p99" + unit]), dist["n"]]


def render(out: dict[str, Any]) -> str:
    """The human-readable tables, in markdown."""
    parts = []
    m, c = out["machine"], out["config"]
    parts.append(
        f"kvhandoff bench: {m['memory']}, ctx_tp={c['ctx_tp']} gen_tp={c['gen_tp']}, "
        f"{m['cpus']} CPUs, load {m['loadavg_start'][0]:.1f}->{m['loadavg_end'][0]:.1f}"
        + (f", chunk {c['chunk_mib']} MiB, N={c['repeats']} (best of N, the median in parentheses)" if "data" in out else "")
        + f", {out.get('command_s', out['wall_s']):.0f} s in all ({out['wall_s']:.0f} s measuring)"
    )
    if "data" in out:
        rows = []
        for r in out["data"]:

            def gbps(key: str, r: dict[str, Any] = r) -> str:
                s = r[key]
                return (
                    f"{_fmt(s.get('best_gbps'))} ({_fmt(s.get('median_gbps'))})"
                    if s["n"]
                    else "n/a"
                )

            rows.append(
                [
                    r["size_mib"],
                    gbps("e2e"),
                    gbps("data"),
                    gbps("raw"),
                    gbps("copy"),
                    f"{_fmt(r['data_over_raw_best'])} ({_fmt(r['data_over_raw_median'])})",
                    f"{_fmt(r['e2e_over_raw_best'])} ({_fmt(r['e2e_over_raw_median'])})",
                    f"{_fmt(r['raw_over_copy_best'])} ({_fmt(r['raw_over_copy_median'])})",
                ]
            )
        parts.append(
            _table(
                "Data plane, large handoffs (GB/s; ratios are throughput ratios, 1 = parity)",
                [
                    "MiB",
                    "e2e handoff",
                    "data phase",
                    "raw NIXL",
                    "copy",
                    "data/raw",
                    "e2e/raw",
                    "raw/copy",
                ],
                rows,
            )
        )
        rows = [
            [
                r["size_mib"],
                _ms(r["e2e"].get("best_s")),
                _ms(r["data"].get("best_s")),
                _ms(r["raw"].get("best_s")),
                _ms(r["copy"].get("best_s")),
                _ms(r["e2e"].get("best_s", math.nan) - r["data"].get("best_s", math.nan)),
                _ms(r.get("control_overhead", {}).get("p50_s")),
                _ms(r.get("control_overhead", {}).get("ping_p50_s")),
            ]
            for r in out["data"]
        ]
        parts.append(
            _table(
                "Data plane, best ms (control overhead: e2e - data phase of the same handoff, p50)",
                ["MiB", "e2e", "data phase", "raw", "copy", "e2e - data", "control overhead p50", "ping p50"],
                rows,
            )
        )
    if "paged" in out and out["paged"] and "staged" in out["paged"][0]:

        def g(r: dict[str, Any], key: str) -> str:
            return f"{_fmt(r[key].get('best_gbps'))} ({_fmt(r[key].get('median_gbps'))})"

        rows = [
            [
                r["block_kib"],
                r["descriptors"],
                g(r, "raw"),
                g(r, "direct"),
                g(r, "staged"),
                g(r, "contiguous"),
                g(r, "copy"),
                f"{_fmt(r['staged_over_direct_best'])} ({_fmt(r['staged_over_direct_median'])})",
                f"{_fmt(r['staged_over_contiguous_best'])} ({_fmt(r['staged_over_contiguous_median'])})",
                r["auto_mode"],
            ]
            for r in out["paged"]
        ]
        parts.append(
            _table(
                "Pieces, CTX TP=2 -> GEN TP=1: raw direct, direct and staged handoffs, contiguous raw (GB/s, best (median))",
                ["piece KiB", "descriptors", "raw", "direct", "staged", "contiguous", "copy", "staged/direct", "staged/contig", "auto"],
                rows,
            )
        )
    elif "paged" in out:
        rows = [
            [
                r["block_kib"],
                r["descriptors"],
                ",".join(str(b) for b in r["descriptor_bytes"]),
                f"{_fmt(r['raw'].get('best_gbps'))} ({_fmt(r['raw'].get('median_gbps'))})",
                f"{_fmt(r['raw_built'].get('best_gbps'))} ({_fmt(r['raw_built'].get('median_gbps'))})",
                f"{_fmt(r['copy'].get('best_gbps'))} ({_fmt(r['copy'].get('median_gbps'))})",
                f"{_fmt(r['raw_over_copy_best'])} ({_fmt(r['raw_over_copy_median'])})",
                f"{_fmt(r['prepared_over_built_best'])} ({_fmt(r['prepared_over_built_median'])})",
            ]
            for r in out["paged"]
        ]
        parts.append(
            _table(
                "Paged descriptors: raw NIXL, every other block (GB/s)",
                [
                    "block KiB",
                    "descriptors",
                    "descriptor B",
                    "raw NIXL",
                    "raw, built descs",
                    "copy",
                    "raw/copy",
                    "prepared/built",
                ],
                rows,
            )
        )
    if "crossover" in out:
        xo = out["crossover"]
        rows = [
            [
                r["blocks"],
                r["descriptors"],
                f"{_fmt(_ms(r['direct'].get('median_s')))} ({_fmt(_ms(r['direct'].get('best_s')))})",
                f"{_fmt(_ms(r['staged'].get('median_s')))} ({_fmt(_ms(r['staged'].get('best_s')))})",
                r["staged_over_direct_median"],
                r["auto_mode"],
            ]
            for r in xo["rows"]
        ]
        parts.append(
            _table(
                f"Staged vs direct by request size, {xo['piece_kib']} KiB pieces: data phase ms, median (best); "
                f"staged wins from {xo['min_descriptors']} descriptors per edge (auto: from {xo['staged_min_descriptors']})",
                ["blocks", "descriptors/edge", "direct", "staged", "staged/direct", "auto"],
                rows,
            )
        )
    if "control" in out:
        ctl = out["control"]
        rows = [
            _p50_p99_row(
                f"small handoff ({ctl['small_tokens']} tokens, {ctl['small_bytes'] // KiB} KiB), ms", ctl["latency"], "_s"
            ),
            _p50_p99_row("Ray actor round trip (ping), ms", ctl["ping"], "_s"),
            ["ratio handoff / ping", ctl["latency_over_ping_p50"], "", ""],
        ]
        parts.append(_table("Control plane latency", ["", "p50", "p99", "n"], rows))
        rows = [
            [
                f"{s['concurrency']} concurrent",
                s["handoffs_per_s"],
                s["completed"],
                _ms(s["latency_p50_s"]),
                _ms(s["latency_p99_s"]),
            ]
            for s in ctl["sustained"]
        ]
        rows.append(
            ["Ray pipelined ping.remote()", ctl["ray_pipelined_calls_per_s"]["best"], "", "", ""]
        )
        rows.append(
            [
                "ratio best handoffs/s / Ray calls/s",
                ctl["sustained_over_pipelined_best"],
                "",
                "",
                "",
            ]
        )
        parts.append(
            _table("Control plane rate", ["", "per s", "completed", "p50 ms", "p99 ms"], rows)
        )
        per = ctl.get("per_handoff")
        if per:
            rows = [["Ray calls", per["ray_calls"]], ["channel messages", per.get("channel_messages", 0)]]
            rows += [["control frames", per["frames"]]]
            rows += [[f"  {kind}", n] for kind, n in sorted(per["by_kind"].items())]
            parts.append(_table(f"Per small handoff (mean over {per['handoffs']})", ["", "mean"], rows))
        hops = ctl.get("hops", {})
        if hops.get("n"):
            common = hops["common_path"]
            rows = [
                [k, s["actor"], s["what"], s["carrier"], f"{s['p50_ms']:.2f}"]
                for k, s in enumerate(common["steps"])
            ]
            title = (
                f"Critical path of a small handoff: {hops['hops_p50']} hops p50 "
                f"(max {hops['hops_max']}, {hops['total_ms_p50']:.1f} ms p50 traced; "
                f"the most common path, {common['share']:.0%} of {hops['n']})"
            )
            parts.append(_table(title, ["#", "actor", "arrived", "by", "ms since previous p50"], rows))
        big = ctl.get("blocks", {})
        if big.get("rows"):
            rows = [
                [r["blocks"], r["n"], _ms(r["e2e_p50_s"]), _ms(r["control_p50_s"]), _fmt(r["over_first_p50"])]
                for r in big["rows"]
            ]
            parts.append(
                _table(
                    f"Control time by request size ({big['block_bytes']} B blocks; end to end - data phase)",
                    ["blocks", "n", "e2e p50 ms", "control p50 ms", "/ first"],
                    rows,
                )
            )
    if "cancel" in out:
        cn = out["cancel"]
        rows = [
            _p50_p99_row("cancel -> handoff returned (every rank released)", cn["release_s"]),
            _p50_p99_row("cancel -> every pool all free (polled)", cn["all_free_s"]),
            ["one chunk (raw NIXL, median)", _ms(out.get("chunk_s")), "", ""],
            ["one agreement round (coordinator p50)", _ms(cn["round_s_p50"]), "", ""],
        ]
        parts.append(
            _table(
                f"Cancel-to-release, {cn['size_mib']} MiB handoffs cancelled after U(0, {cn['max_delay_s'] * 1e3:.0f} ms); "
                f"outcomes {cn['outcomes']}, leaked blocks per rank {cn['leaked_blocks_per_rank']}, "
                f"quarantined {cn['quarantined_blocks']}",
                ["ms", "p50", "p99", "n"],
                rows,
            )
        )
    if "frames" in out:
        rows = []
        for r in out["frames"]["sizes"]:
            for v, s in r["one_way"].items():
                burst = r["burst"].get(v, {})
                rows.append([
                    r["bytes"], v, s.get("p50_us"), s.get("p99_us"),
                    r["pingpong_cpu_us_per_frame"][v], burst.get("frames_per_s", ""),
                    burst.get("a_to_b", {}).get("send_cpu_us_per_frame", ""),
                    burst.get("a_to_b", {}).get("recv_cpu_us_per_frame", ""),
                ])
        parts.append(_table(
            f"Control frames: one way = ping-pong RTT/2 (N={out['frames']['n_round_trips']}), "
            f"burst of {out['frames']['burst']} each way (slower direction)",
            ["bytes", "transport", "one-way p50 us", "p99 us", "CPU us/frame",
             "burst frames/s", "send CPU us/frame", "recv CPU us/frame"],
            rows,
        ))
    rows, whys = [], []
    for t in out["targets"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        if t.get("why"):
            whys.append(t["why"])
            verdict += f" ({len(whys)})"
        rows.append([t["target"], t["value"], f"{t['op']} {_fmt(t['bound'])}", verdict, t["note"]])
    if out.get("scale"):
        from kvhandoff.cli._bench_scale import scale_table

        scale_headers, scale_rows = scale_table(out["scale"])
        parts.append(_table("Scale: aggregate small-handoff rate of fleets (tp=1 instances)", scale_headers, scale_rows))
    if out.get("soak"):
        from kvhandoff.cli._bench_soak import soak_table

        soak_headers, soak_rows = soak_table(out["soak"])
        parts.append(_table("Soak: resident memory of every process", soak_headers, soak_rows))
    parts.append(_table("Targets (docs/design.md)", ["target", "measured", "bound", "", "note"], rows))
    parts += [f"({i}) why not met: {why}" for i, why in enumerate(whys, 1)]
    if out["notes"]:
        parts.append("\nnotes: " + "; ".join(out["notes"]))
    return "\n".join(parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None if math.isnan(value) else "inf"
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def run(args: argparse.Namespace) -> int:
    """Run the selected sections; print tables (or `--json`). Exit 0 when every
    run section produced numbers (targets not met is a finding, not an error).

    `args` are the `kvhandoff bench` flags (cli/_flags.py). Progress goes to
    stderr (cli/_console.py); with `--json`, none."""
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        print(f"unknown sections: {sorted(unknown)} (choose from {SECTIONS})", file=sys.stderr)
        return 2
    if args.plot:
        from kvhandoff.cli._plots import missing

        why = missing()
        if why:  # before anything starts
            print(f"kvhandoff bench: {why}", file=sys.stderr)
            return 2
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by the Ray workers we start
    reporter = Reporter("kvhandoff bench", quiet=args.json)
    began = time.perf_counter()
    started_ray = False
    if not ray.is_initialized():
        # Ray's own INFO/WARNING lines would bury the tables (and a one-line error).
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
        if args.address:
            kw["address"] = args.address
        elif not os.environ.get("RAY_ADDRESS"):
            # A new cluster, even if another one runs on this machine (Ray
            # would join the latest one); RAY_AUTH_MODE: see cli.py.
            kw["address"] = "local"
        where = args.address or os.environ.get("RAY_ADDRESS")
        try:
            with reporter.step(f"joining the Ray cluster at {where}" if where else "starting a local Ray cluster", done="Ray ready"):
                ray.init(**kw)
        except Exception as exc:  # one line (cli.main already checked that a GCS answers there)
            from kvhandoff.cli._address import init_error

            if where:
                line = init_error(exc, where, os.environ)
            else:
                line = "could not start Ray: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"kvhandoff bench: {line}", file=sys.stderr)
            return 2
        started_ray = True
    failed: _LaunchFailed | None = None
    # With --json, stdout carries the one JSON object: what Ray's driver
    # prints there meanwhile (its raylet's warnings, and the repeated ones
    # its log deduplication flushes at shutdown) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        try:
            out = asyncio.run(_Bench(args, reporter).run())
        except _LaunchFailed as exc:
            failed = exc
        finally:
            if started_ray:
                with reporter.step("stopping Ray", done="Ray stopped"):
                    ray.shutdown()
    if failed is not None:  # one line, the last
        print(f"kvhandoff bench: could not launch the deployment: {failed}", file=sys.stderr)
        return 2
    out["command_s"] = time.perf_counter() - began  # Ray's start and stop included
    if args.plot:
        from kvhandoff.cli._plots import write_plots

        with reporter.step(f"writing plots into {args.plot}", done="plots written"):
            out["plots"] = [str(p) for p in write_plots(out, args.plot)]
    if args.json:
        print(json.dumps(_jsonable(out), default=str))
    else:
        print(render(out))
        if args.plot:
            print("\nplots: " + ", ".join(out["plots"]))
    return 0
