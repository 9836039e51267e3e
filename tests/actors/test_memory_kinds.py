"""Memory kinds in the data plane: engine tensors checked, logical blocks read
and written at their physical places, and real NIXL WRITEs between two agents
of different kinds and TPs (in this process) landing every byte where the
GEN's kind says."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvhandoff.actors._dataplane import (
    DataPlaneError,
    KVMemory,
    MemoryLayoutError,
    NixlTransport,
    XferState,
    edge_pieces,
    plan_chunks,
)
from kvhandoff.actors._pattern import expected_blocks
from kvhandoff.topology import (
    MEMORY_KINDS,
    KVLayout,
    memory_pieces,
    memory_regions,
    region_block_bytes,
    row_place,
    shard_map,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", tokens_per_block=4)
FP8 = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float8_e4m3fn", tokens_per_block=2)
_names = itertools.count()


def engine_tensors(kind: str, layout: KVLayout, tp: int, nb: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors shaped as an engine of `kind` would allocate them."""
    hl, T, D, L = layout.num_kv_heads // tp, layout.tokens_per_block, layout.head_dim, layout.num_layers
    shape = {
        "blocked": (nb, L, 2, hl, T, D),
        "paged": (nb, 2, T, hl, D),
        "paged_hnd": (nb, 2, hl, T, D),
        "split": (nb, T, hl, D),
        "paged_interleaved": (nb, hl, T, 2, D),  # vLLM's CPU attention cache
    }[kind]
    return [torch.zeros(shape, dtype=dtype) for _ in range(memory_regions(kind, layout))]


def pattern(layout: KVLayout, tp: int, rank: int, n: int, seed: int = 5) -> torch.Tensor:
    hl = layout.num_kv_heads // tp
    return expected_blocks(
        seed,
        num_layers=layout.num_layers,
        local_heads=hl,
        head_offset=rank * hl,
        tokens_per_block=layout.tokens_per_block,
        row_bytes=layout.head_dim * layout.dtype_bytes,
        first_block=0,
        num_blocks=n,
    )


# -- from_tensors: refusals are typed and change nothing ------------------------------


def _bad_inputs() -> list[tuple[str, str, list]]:
    good = engine_tensors("paged", LAYOUT, 2, 4, torch.float16)
    shared = torch.zeros(8, 2, 4, 2, 8, dtype=torch.float16)
    return [
        ("unknown kind", "vllm", good),
        ("too few tensors", "paged", good[:1]),
        ("too many tensors", "paged", [*good, good[0].clone()]),
        ("one tensor, not a list", "paged", good[0]),  # type: ignore[list-item]
        ("not a tensor", "paged", [good[0], "kv"]),
        ("wrong dtype bytes", "paged", [t.float() for t in good]),
        ("wrong shape (NHD vs HND)", "paged", engine_tensors("paged_hnd", LAYOUT, 2, 4, torch.float16)),
        ("wrong head count (other tp)", "paged", engine_tensors("paged", LAYOUT, 1, 4, torch.float16)),
        ("blocks differ", "paged", [good[0], torch.zeros(5, 2, 4, 2, 8, dtype=torch.float16)]),
        ("not contiguous", "paged", [good[0], torch.zeros(4, 2, 2, 4, 8, dtype=torch.float16).transpose(2, 3)]),
        ("another device", "paged", [good[0], torch.zeros(4, 2, 4, 2, 8, dtype=torch.float16, device="meta")]),
        ("two tensors share memory", "paged", [shared[:4], shared[3:7]]),
        ("the same tensor twice", "paged", [good[0], good[0]]),
        ("no blocks", "paged", [torch.zeros(0, 2, 4, 2, 8, dtype=torch.float16)] * 2),
    ]


@pytest.mark.parametrize(("kind", "tensors"), [pytest.param(k, t, id=n) for n, k, t in _bad_inputs()])
def test_from_tensors_refuses_typed_and_changes_nothing(kind: str, tensors: list) -> None:
    before = [t.clone() for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    with pytest.raises(MemoryLayoutError) as err:
        KVMemory.from_tensors(kind, LAYOUT, 2, tensors)
    assert isinstance(err.value, DataPlaneError)
    after = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_refused_engine_memory_registers_nothing_and_a_rank_is_not_built() -> None:
    """The rank builds its memory before its NIXL agent: a refusal leaves no agent."""
    import kvhandoff.actors._dataplane as dp

    made: list[str] = []
    real_init = dp.NixlTransport.__init__

    def spy(self, name, buffer):  # type: ignore[no-untyped-def]
        made.append(name)
        real_init(self, name, buffer)

    dp.NixlTransport.__init__ = spy  # type: ignore[method-assign]
    try:
        with pytest.raises(MemoryLayoutError):
            KVMemory.from_tensors("split", LAYOUT, 2, engine_tensors("paged", LAYOUT, 2, 4, torch.float16))
    finally:
        dp.NixlTransport.__init__ = real_init  # type: ignore[method-assign]
    assert made == []


# -- logical blocks at their physical places --------------------------------------------


@pytest.mark.parametrize("kind", MEMORY_KINDS)
@pytest.mark.parametrize(("layout", "dtype"), [(LAYOUT, torch.float16), (FP8, torch.float8_e4m3fn)], ids=["fp16", "fp8"])
def test_logical_blocks_land_at_the_row_places(kind: str, layout: KVLayout, dtype: torch.dtype) -> None:
    tp, nb = 2, 5
    tensors = engine_tensors(kind, layout, tp, nb, dtype)
    mem = KVMemory.from_tensors(kind, layout, tp, tensors)
    assert mem.num_blocks == nb and mem.block_bytes == layout.num_layers * 2 * 1 * layout.head_bytes * (
        layout.num_kv_heads // tp
    )
    assert len(mem.region_table()) == memory_regions(kind, layout)
    assert all(stride == region_block_bytes(kind, layout, tp) for _, stride in mem.region_table())
    data = torch.randint(0, 256, (2, mem.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    mem.write_blocks([3, 1], data)
    assert torch.equal(mem.read_blocks([3, 1]), data)
    # Byte for byte, in the engine's own tensors, where topology says each row lives.
    hl, T, row = layout.num_kv_heads // tp, layout.tokens_per_block, layout.head_dim * layout.dtype_bytes
    raw = [t.view(torch.uint8).reshape(nb, -1) for t in tensors]
    for j, block in enumerate((3, 1)):
        logical = data[j].view(layout.num_layers, 2, hl, T, row)
        for layer, kv, h, t in itertools.product(range(layout.num_layers), (0, 1), range(hl), range(T)):
            r, off = row_place(kind, layout, tp, layer=layer, kv=kv, head=h, token=t)
            assert torch.equal(raw[r][block, off : off + row], logical[layer, kv, h, t])
    untouched = [b for b in range(nb) if b not in (1, 3)]
    assert int(mem.read_blocks(untouched).max()) == 0
    mem.fill_blocks([1], 0xDB)
    assert set(mem.read_blocks([1]).unique().tolist()) == {0xDB}
    assert torch.equal(mem.read_blocks([3]), data[:1])


def test_block_addr_is_region_0_and_geometry_carries_the_regions() -> None:
    mem = KVMemory.allocate("split", LAYOUT, 2, 4)
    geo = mem.geometry()
    assert geo.block_addr(3) == mem.block_addr(3) == mem.bases[0] + 3 * region_block_bytes("split", LAYOUT, 2)
    assert geo.region_table() == mem.region_table() and len(geo.regions) == 4 and geo.kind == "split"
    assert geo.block_bytes == mem.block_bytes
    blocked = KVMemory.allocate("blocked", LAYOUT, 2, 4)
    assert blocked.geometry().regions == () and blocked.block_view(2).numel() == blocked.block_bytes
    with pytest.raises(DataPlaneError):
        mem.block_view(0)
    with pytest.raises(DataPlaneError):
        mem.read_blocks([4])


# -- real NIXL WRITEs between two kinds ---------------------------------------------------


def _transfer(ctx_kind: str, gen_kind: str, layout: KVLayout, dtype: torch.dtype, ctx_tp: int, gen_tp: int, prepared: bool) -> None:
    nb, chunk = 6, 1 << 10
    sm = shard_map(layout, ctx_tp, gen_tp)
    n = next(_names)
    ctx = [
        NixlTransport(f"mk-c{n}.{c}", KVMemory.from_tensors(ctx_kind, layout, ctx_tp, engine_tensors(ctx_kind, layout, ctx_tp, nb, dtype)))
        for c in range(ctx_tp)
    ]
    gen = [NixlTransport(f"mk-g{n}.{g}", KVMemory.allocate(gen_kind, layout, gen_tp, nb)) for g in range(gen_tp)]
    try:
        ctx_blocks, gen_blocks = [0, 1, 2, 5], [4, 5, 0, 2]
        for c, t in enumerate(ctx):
            t.buffer.write_blocks(ctx_blocks, pattern(layout, ctx_tp, c, 4))
        for g in gen:
            g.buffer.fill_blocks(range(nb), 0xDB)
        chunks = []
        for c, g in sm.edges:
            src, dst = ctx[c], gen[g]
            src.add_peer(dst.metadata())
            pieces = edge_pieces(memory_pieces(sm, (c, g), ctx_kind, gen_kind), chunk)
            theirs = dst.buffer.geometry()
            lists = src.prepare(dst.name, pieces, theirs) if prepared else None
            for plan in plan_chunks(pieces, list(zip(ctx_blocks, gen_blocks)), chunk, src.buffer.region_table(), theirs.region_table()):
                chunks.append(src.post(dst.name, plan, prepared=lists))
        for _ in range(200000):
            if all(ch.poll() in (XferState.DONE, XferState.ERR) for ch in chunks):
                break
            for t in gen:  # the targets progress (agents have no progress thread)
                t.agent.get_new_notifs()
        assert {ch.state for ch in chunks} == {XferState.DONE}
        assert all(ch.release() for ch in chunks)
        for g, t in enumerate(gen):
            assert torch.equal(t.buffer.read_blocks(gen_blocks), pattern(layout, gen_tp, g, 4)), f"gen {g}"
            others = [b for b in range(nb) if b not in gen_blocks]
            assert set(t.buffer.read_blocks(others).unique().tolist()) == {0xDB}  # not one byte more
    finally:
        for t in ctx + gen:
            t.close()


@pytest.mark.parametrize(
    ("ctx_kind", "gen_kind"),
    [("paged", "paged"), ("paged_hnd", "split"), ("split", "paged"), ("blocked", "paged_hnd"), ("paged", "blocked")],
)
@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(2, 1), (1, 2)])
def test_real_writes_between_kinds_land_every_byte(ctx_kind: str, gen_kind: str, ctx_tp: int, gen_tp: int) -> None:
    _transfer(ctx_kind, gen_kind, LAYOUT, torch.float16, ctx_tp, gen_tp, prepared=True)


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "built"])
def test_real_writes_fp8_split_to_paged_both_paths(prepared: bool) -> None:
    _transfer("split", "paged", FP8, torch.float8_e4m3fn, 2, 2, prepared)
    _transfer("paged_hnd", "split", FP8, torch.float8_e4m3fn, 1, 2, prepared)


def test_prepare_refuses_a_piece_outside_its_region() -> None:
    n = next(_names)
    a = NixlTransport(f"mk-pa{n}", KVMemory.allocate("paged", LAYOUT, 1, 2))
    b = NixlTransport(f"mk-pb{n}", KVMemory.allocate("split", LAYOUT, 1, 2))
    try:
        a.add_peer(b.metadata())
        theirs = b.buffer.geometry()
        stride = region_block_bytes("split", LAYOUT, 1)
        for bad in [(0, 0, 4, 0, 8), (2, 0, 0, 0, 8), (0, 0, 0, stride - 4, 8)]:  # no region 4 / 2; past the block
            with pytest.raises(DataPlaneError):
                a.prepare(b.name, (bad,), theirs)
    finally:
        a.close()
        b.close()
