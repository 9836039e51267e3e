"""The data plane on real NIXL agents in two Ray actors, moving real host bytes."""

from __future__ import annotations

import pytest
import ray

from kvhandoff.actors._dataplane import (
    DataPlaneError,
    FaultPlan,
    FaultyTransport,
    KVBuffer,
    NixlTransport,
    XferState,
    split_chunks,
)

pytestmark = pytest.mark.ray

BLOCK = 64 << 10
BLOCKS = 32


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
        regions = [(self.buffer.block_addr(b), remote_base + b * BLOCK, BLOCK) for b in blocks]
        for chunk in split_chunks(regions, chunk_bytes):
            self.chunks.append(self.transport.post(peer, chunk))
        return len(self.chunks)

    def poll_all(self, max_polls: int = 100000) -> list[str]:
        for _ in range(max_polls):
            if all(c.poll() in (XferState.DONE, XferState.ERR) for c in self.chunks):
                break
        return [c.state.value for c in self.chunks]

    def states(self) -> list[str]:
        return [c.state.value for c in self.chunks]

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


def test_split_chunks_covers_every_byte_once() -> None:
    regions = [(0, 1000, 100), (100, 1100, 250), (1000, 5000, 7)]
    chunks = split_chunks(regions, 64)
    flat = [r for c in chunks for r in c]
    assert sum(n for _, _, n in flat) == 357
    assert all(sum(n for _, _, n in c) <= 64 for c in chunks)
    covered = sorted((s, s + n) for s, _, n in flat)
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:]))
    for s, d, _ in flat:  # src/dst offsets stay paired
        base = next(r for r in regions if r[0] <= s < r[0] + r[2])
        assert d - s == base[1] - base[0]
    with pytest.raises(DataPlaneError):
        split_chunks(regions, 0)


def test_chunked_write_moves_real_bytes(pair) -> None:
    a, b = pair
    ray.get([a.fill.remote(7), b.fill.remote(0)])
    n = ray.get(a.post.remote("dp-b", [1, 3, 4, 5, 9], ray.get(b.base.remote()), 100 << 10))
    assert n >= 3  # 5 blocks of 64 KiB in ~100 KiB chunks
    assert set(ray.get(a.poll_all.remote())) == {"DONE"}
    assert all(ray.get(a.release_all.remote()))
    values = ray.get(b.block_values.remote())
    assert [i for i, v in enumerate(values) if v == 7] == [1, 3, 4, 5, 9]
    assert all(v == 0 for i, v in enumerate(values) if i not in (1, 3, 4, 5, 9))


def test_bad_descriptors_are_typed_errors(pair) -> None:
    a, _ = pair
    assert ray.get(a.bad_post.remote("dp-b")).startswith("DataPlaneError")
    assert ray.get(a.bad_post.remote("nobody")).startswith("DataPlaneError")


def test_in_flight_chunk_is_never_released_and_bytes_land_late(ray_cluster) -> None:
    a, b = Side.remote("dp-fa", True), Side.remote("dp-fb")
    ray.get(a.add_peer.remote(ray.get(b.metadata.remote())))
    ray.get([a.fill.remote(5), b.fill.remote(0), a.set_plan.remote(hold=True)])
    ray.get(a.post.remote("dp-fb", [2], ray.get(b.base.remote()), BLOCK))
    assert ray.get(a.poll_all.remote(50)) == ["PROC"]
    assert ray.get(a.release_all.remote()) == [False]  # refused: in flight is not an abort
    assert ray.get(b.block_values.remote())[2] == 0  # nothing landed yet
    ray.get(a.set_plan.remote(hold=False, defer_polls=1))
    assert ray.get(a.poll_all.remote()) == ["DONE"]
    assert ray.get(b.block_values.remote())[2] == 5  # the late write really lands
    assert ray.get(a.release_all.remote()) == [True]
    ray.get(a.set_plan.remote(fail_every=1))
    ray.get(a.post.remote("dp-fb", [3], ray.get(b.base.remote()), BLOCK))
    assert ray.get(a.poll_all.remote()) == ["ERR"]
    assert ray.get(a.release_all.remote()) == [True]
    assert ray.get(b.block_values.remote())[3] == 0
    ray.kill(a)
    ray.kill(b)
