"""The data plane on real NIXL agents in two Ray actors, moving real host bytes."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.actors._dataplane import (
    BufferGeometry,
    DataPlaneError,
    KVBuffer,
    NixlTransport,
    XferState,
    edge_pieces,
    plan_chunks,
)
from kvhandoff.actors._faults import FaultPlan, FaultyTransport

pytestmark = pytest.mark.ray

BLOCK = 64 << 10
BLOCKS = 32


def poll_both(a, b, rounds: int = 5000) -> list[str]:
    """Poll `a`'s chunks to DONE/ERR while the target `b` progresses."""
    states: list[str] = []
    for _ in range(rounds):
        states = ray.get(a.poll_all.remote(20))
        if all(s in ("DONE", "ERR") for s in states):
            break
        ray.get(b.progress.remote())
    return states


@ray.remote(num_cpus=0)
class Side:
    def __init__(self, name: str, faulty: bool = False) -> None:
        self.buffer = KVBuffer(BLOCKS, BLOCK)
        cls = FaultyTransport if faulty else NixlTransport
        self.transport = cls(name, self.buffer)
        self.chunks: list = []

    def metadata(self) -> bytes:
        return self.transport.metadata()

    def add_peer(self, md: bytes) -> str:
        return self.transport.add_peer(md)

    def base(self) -> int:
        return self.buffer.base

    def geometry(self) -> BufferGeometry:
        return self.buffer.geometry()

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.buffer.tensor.copy_(
            torch.randint(0, 256, (BLOCKS * BLOCK,), generator=g, dtype=torch.uint8)
        )

    def contents(self) -> bytes:
        return self.buffer.tensor.numpy().tobytes()

    def post_plan(
        self,
        peer: str,
        pairs: list[tuple[int, int]],
        pieces: tuple,
        chunk_bytes: int,
        their: BufferGeometry,
        prepared: bool,
    ) -> tuple[int, bool]:
        ours = self.buffer.geometry()
        lists = self.transport.prepare(peer, pieces, their) if prepared else None
        for plan in plan_chunks(pieces, pairs, chunk_bytes, ours.region_table(), their.region_table()):
            self.chunks.append(self.transport.post(peer, plan, prepared=lists))
        again = self.transport.prepare(peer, pieces, their) if prepared else None
        return len(self.chunks), lists is not None and lists is again

    def try_prepare(self, peer: str, pieces: tuple, their: BufferGeometry) -> str:
        try:
            self.transport.prepare(peer, pieces, their)
        except DataPlaneError as exc:
            return f"DataPlaneError: {exc}"
        return "prepared"

    def fill(self, value: int) -> None:
        self.buffer.tensor.fill_(value)

    def block_values(self) -> list[int]:
        t = self.buffer.tensor.view(BLOCKS, BLOCK)
        return [
            int(t[i].min()) if int(t[i].min()) == int(t[i].max()) else -1 for i in range(BLOCKS)
        ]

    def set_plan(self, **kw) -> None:
        self.transport.plan = FaultPlan(**kw)

    def post(self, peer: str, blocks: list[int], remote_base: int, chunk_bytes: int) -> int:
        pairs = [(b, b) for b in blocks]
        pieces = edge_pieces([(0, 0, BLOCK)], chunk_bytes)
        tables = self.buffer.region_table(), ((remote_base, BLOCK),)
        for plan in plan_chunks(pieces, pairs, chunk_bytes, *tables):
            self.chunks.append(self.transport.post(peer, plan))  # the built path
        return len(self.chunks)

    def poll_all(self, max_polls: int = 100000) -> list[str]:
        for _ in range(max_polls):
            if all(c.poll() in (XferState.DONE, XferState.ERR) for c in self.chunks):
                break
        return [c.state.value for c in self.chunks]

    def states(self) -> list[str]:
        return [c.state.value for c in self.chunks]

    def progress(self) -> int:
        """Progress this agent's worker (agents have no progress thread: a
        WRITE's target progresses, as a GEN rank's poll loop does)."""
        return sum(len(v) for v in self.transport.agent.get_new_notifs().values())

    def partial_left(self) -> int:
        return self.transport.progress_partial()

    def release_all(self) -> list[bool]:
        out = [c.release() for c in self.chunks]
        self.chunks = [c for c in self.chunks if not c.released]
        return out

    def bad_post(self, peer: str) -> str:
        try:
            self.transport.post(peer, [(self.buffer.base, 1 << 40, 4096)])
        except DataPlaneError as exc:
            return f"DataPlaneError: {exc}"
        return "posted"


@pytest.fixture(scope="module")
def pair(ray_cluster):
    a, b = Side.remote("dp-a"), Side.remote("dp-b")
    ray.get(a.add_peer.remote(ray.get(b.metadata.remote())))
    ray.get(b.add_peer.remote(ray.get(a.metadata.remote())))
    yield a, b
    for h in (a, b):
        ray.kill(h)


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=4),
    st.integers(1, 40),
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=6),
    st.integers(1, 120),
)
def test_plans_cover_every_byte_once_in_both_forms(lengths, max_piece, pairs, chunk_bytes) -> None:
    # Segments of a 200-byte CTX block land swapped around in a 300-byte GEN block.
    segments, src, dst = [], 0, 300
    for n in lengths:
        dst -= n
        segments.append((src, dst, n))
        src += n
    pieces = edge_pieces(segments, min(max_piece, chunk_bytes))
    assert all(0 < p[4] <= min(max_piece, chunk_bytes) and p[0] == p[2] == 0 for p in pieces)
    assert sum(p[4] for p in pieces) == sum(lengths)
    ours = BufferGeometry(base=1 << 20, num_blocks=8, block_bytes=200, mem_kind="DRAM", device_id=0)
    theirs = BufferGeometry(
        base=9 << 20, num_blocks=8, block_bytes=300, mem_kind="DRAM", device_id=0
    )
    plans = plan_chunks(pieces, pairs, chunk_bytes, ours.region_table(), theirs.region_table())
    assert all(0 < p.nbytes <= chunk_bytes for p in plans)
    # The byte mapping the edge must perform: every (src byte -> dst byte) once.
    want = sorted(
        (ours.block_addr(c) + s0 + k, theirs.block_addr(g) + d0 + k)
        for c, g in pairs
        for s0, d0, n in segments
        for k in range(n)
    )
    by_regions = sorted(
        (s0 + k, d0 + k) for p in plans for s0, d0, n in p.regions for k in range(n)
    )
    assert by_regions == want
    # The index form names the same bytes through the prepared lists' row layout.
    per = len(pieces)
    by_index = []
    for p in plans:
        assert len(p.local) == len(p.remote) and p.local.dtype == np.int32
        for i, j in zip(p.local.tolist(), p.remote.tolist()):
            _, s0, _, _, n = pieces[i % per]
            _, _, _, d0, m = pieces[j % per]
            assert i % per == j % per and n == m
            base_s, base_d = ours.block_addr(i // per) + s0, theirs.block_addr(j // per) + d0
            by_index += [(base_s + k, base_d + k) for k in range(n)]
    assert sorted(by_index) == want
    with pytest.raises(DataPlaneError):
        plan_chunks(pieces, pairs, 0)
    with pytest.raises(DataPlaneError):
        edge_pieces(segments, 0)


def test_adjacent_blocks_merge_into_one_region() -> None:
    ours = BufferGeometry(0x1000, 8, 64, "DRAM", 0)
    theirs = BufferGeometry(0x9000, 8, 64, "DRAM", 0)
    pieces = edge_pieces([(0, 0, 64)], 1024)
    pairs = [(b, b + 1) for b in (2, 3, 4)]
    (plan,) = plan_chunks(pieces, pairs, 1024, ours.region_table(), theirs.region_table())
    assert plan.regions == ((0x1000 + 128, 0x9000 + 192, 192),)
    assert plan.local.tolist() == [2, 3, 4] and plan.remote.tolist() == [3, 4, 5]


def test_chunked_write_moves_real_bytes(pair) -> None:
    a, b = pair
    ray.get([a.fill.remote(7), b.fill.remote(0)])
    n = ray.get(a.post.remote("dp-b", [1, 3, 4, 5, 9], ray.get(b.base.remote()), 100 << 10))
    assert n >= 3  # 5 blocks of 64 KiB in ~100 KiB chunks
    assert set(poll_both(a, b)) == {"DONE"}
    assert all(ray.get(a.release_all.remote()))
    values = ray.get(b.block_values.remote())
    assert [i for i, v in enumerate(values) if v == 7] == [1, 3, 4, 5, 9]
    assert all(v == 0 for i, v in enumerate(values) if i not in (1, 3, 4, 5, 9))


def test_bad_descriptors_are_typed_errors(pair) -> None:
    a, _ = pair
    assert ray.get(a.bad_post.remote("dp-b")).startswith("DataPlaneError")
    assert ray.get(a.bad_post.remote("nobody")).startswith("DataPlaneError")


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "built"])
def test_prepared_and_built_paths_move_exactly_the_mapped_bytes(pair, prepared) -> None:
    a, b = pair
    ray.get([a.fill_random.remote(11), b.fill.remote(0)])
    # Two pieces per block, landing swapped (a heterogeneous-TP-like shard), and
    # block pairs both adjacent (merge) and scattered.
    half = BLOCK // 2
    pieces = edge_pieces([(0, half, half), (half, 0, half)], 24 << 10)
    pairs = [(1, 4), (2, 5), (3, 6), (9, 0), (30, 17)]
    n, cached = ray.get(
        a.post_plan.remote("dp-b", pairs, pieces, 100 << 10, ray.get(b.geometry.remote()), prepared)
    )
    assert n >= 3 and cached is prepared  # the prepared lists are built once, then reused
    assert set(poll_both(a, b)) == {"DONE"}
    assert all(ray.get(a.release_all.remote()))
    src = np.frombuffer(ray.get(a.contents.remote()), dtype=np.uint8).reshape(BLOCKS, BLOCK)
    dst = np.frombuffer(ray.get(b.contents.remote()), dtype=np.uint8).reshape(BLOCKS, BLOCK)
    want = np.zeros_like(dst)
    for c, g in pairs:
        want[g, half:] = src[c, :half]
        want[g, :half] = src[c, half:]
    assert np.array_equal(dst, want)  # every mapped byte, and not one byte more


def test_prepare_refuses_bad_geometry_and_unknown_peers(pair) -> None:
    a, b = pair
    theirs = ray.get(b.geometry.remote())
    pieces = edge_pieces([(0, 0, BLOCK)], BLOCK)
    assert ray.get(a.try_prepare.remote("nobody", pieces, theirs)).startswith("DataPlaneError")
    outside = edge_pieces([(0, BLOCK // 2, BLOCK)], BLOCK)  # runs past the GEN block
    assert ray.get(a.try_prepare.remote("dp-b", outside, theirs)).startswith("DataPlaneError")
    unregistered = theirs._replace(base=theirs.base + (1 << 30))  # memory dp-b never registered
    assert ray.get(a.try_prepare.remote("dp-b", pieces, unregistered)).startswith("DataPlaneError")


def test_in_flight_chunk_is_never_released_and_bytes_land_late(ray_cluster) -> None:
    a, b = Side.remote("dp-fa", True), Side.remote("dp-fb")
    ray.get(a.add_peer.remote(ray.get(b.metadata.remote())))
    ray.get([a.fill.remote(5), b.fill.remote(0), a.set_plan.remote(hold=True)])
    ray.get(a.post.remote("dp-fb", [2], ray.get(b.base.remote()), BLOCK))
    assert ray.get(a.poll_all.remote(50)) == ["PROC"]
    assert ray.get(a.release_all.remote()) == [False]  # refused: in flight is not an abort
    assert ray.get(b.block_values.remote())[2] == 0  # nothing landed yet
    ray.get(a.set_plan.remote(hold=False, defer_polls=1))
    assert poll_both(a, b) == ["DONE"]
    assert ray.get(b.block_values.remote())[2] == 5  # the late write really lands
    assert ray.get(a.release_all.remote()) == [True]
    ray.get(a.set_plan.remote(fail_every=1))
    ray.get(a.post.remote("dp-fb", [3], ray.get(b.base.remote()), BLOCK))
    assert poll_both(a, b) == ["ERR"]
    assert ray.get(a.release_all.remote()) == [True]
    assert ray.get(b.block_values.remote())[3] == 0
    ray.kill(a)
    ray.kill(b)


def test_partial_failure_reports_err_and_its_write_still_lands(ray_cluster) -> None:
    """The harness's partial failure: a WRITE of several descriptors reports
    ERR at once while its bytes really go. Its handle is kept (unproven), the
    transport polls the real WRITE to its end (polling it again while it
    runs, never recursing), and the stray bytes land in the target."""
    a, b = Side.remote("dp-pa", True), Side.remote("dp-pb")
    ray.get(a.add_peer.remote(ray.get(b.metadata.remote())))
    ray.get([a.fill.remote(6), b.fill.remote(0), a.set_plan.remote(fail_partial_every=1)])
    ray.get(a.post.remote("dp-pb", [1, 3, 5], ray.get(b.base.remote()), 3 * BLOCK))  # one chunk, 3 descriptors
    assert ray.get(a.states.remote()) == ["ERR"]  # reported at once
    assert ray.get(a.release_all.remote()) == [False]  # unproven: kept, never released
    ray.get(a.set_plan.remote())  # no more faults: a normal chunk polls the partial one too
    ray.get(a.post.remote("dp-pb", [7], ray.get(b.base.remote()), BLOCK))
    for _ in range(5000):
        if ray.get(a.partial_left.remote()) == 0 and ray.get(a.poll_all.remote(20))[-1] == "DONE":
            break
        ray.get(b.progress.remote())
    assert ray.get(a.partial_left.remote()) == 0
    assert ray.get(a.states.remote()) == ["ERR", "DONE"]
    values = ray.get(b.block_values.remote())
    assert [i for i, v in enumerate(values) if v == 6] == [1, 3, 5, 7]  # the stray bytes landed too
    ray.kill(a)
    ray.kill(b)
