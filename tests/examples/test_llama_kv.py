"""examples/llama_kv.py: the split prefill(tp=2) -> paged pools -> decode(tp=1) path is token-exact.

The transfer between the prefill ranks' pools and the decode pool is emulated by a
block-by-block copy into the head slice each rank owns, with block ids that differ from
the prefill side's. The negative tests (wrong request's blocks, swapped head halves, a
corrupted byte region) show that the equality check can fail.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

_PATH = Path(__file__).resolve().parents[2] / "examples" / "llama_kv.py"
_spec = importlib.util.spec_from_file_location("llama_kv", _PATH)
assert _spec is not None and _spec.loader is not None
lk = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("llama_kv", lk)
_spec.loader.exec_module(lk)

TPB = 16
NEW = 16
TP = 2
N_PROMPTS = 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on a loaded 2-core box two threads oversubscribe and a 20 ms
    decode can take a second. Both sides of every comparison run under the same setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weights_digest(dtype_name: str) -> str:
    import hashlib

    model = lk.build_model(dtype=getattr(torch, dtype_name))
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Request:
    """One prompt's trip through the split path, over pools shared by all requests."""

    def __init__(self, prompt: list[int], kv, first: int, ctx_blocks, gen_blocks):
        self.prompt = prompt
        self.kv = kv
        self.first = first
        self.ctx_blocks = ctx_blocks  # per rank: that rank's block ids
        self.gen_blocks = gen_blocks


def _transfer(ctx_pools, gen_pool, req: Request, *, swap_heads: bool = False) -> None:
    """What the transfer library does: copy each rank's blocks into its head slice."""
    h = ctx_pools[0][0].shape[3]
    for rank, pool in enumerate(ctx_pools):
        dst_rank = (TP - 1 - rank) if swap_heads else rank
        for src, dst in zip(pool, gen_pool, strict=True):
            for sb, db in zip(req.ctx_blocks[rank], req.gen_blocks, strict=True):
                dst[db, :, :, dst_rank * h : (dst_rank + 1) * h] = src[sb]


def _split_setup(model, prompts, seed: int = 0):
    """Prefill every prompt, shard its heads into two rank pools, transfer, return all."""
    H = model.config.num_key_value_heads
    h = H // TP
    nblocks = [-(-len(p) // TPB) for p in prompts]
    total = sum(nblocks)
    g = torch.Generator().manual_seed(seed)
    # Each rank and the decode side allocate blocks independently (shuffled free lists,
    # with spare blocks), so the same request has different block ids on each side.
    free = [torch.randperm(total + 7, generator=g).tolist() for _ in range(TP + 1)]
    ctx_pools = [
        lk.alloc_pool(model, total + 7, kv_heads=h, tokens_per_block=TPB, device="cpu")
        for _ in range(TP)
    ]
    gen_pool = lk.alloc_pool(model, total + 7, kv_heads=H, tokens_per_block=TPB, device="cpu")
    # Stale bytes everywhere: NaN in any slot the decode side wrongly reads poisons it.
    for pool in [*ctx_pools, gen_pool]:
        for t in pool:
            t.fill_(float("nan"))
    reqs = []
    for prompt, nb in zip(prompts, nblocks, strict=True):
        kv, first = lk.prefill(model, prompt)
        ctx_blocks = [[free[r].pop() for _ in range(nb)] for r in range(TP)]
        gen_blocks = [free[TP].pop() for _ in range(nb)]
        for r in range(TP):
            lk.write_pool(ctx_pools[r], ctx_blocks[r], kv, head_lo=r * h, head_hi=(r + 1) * h)
        req = Request(prompt, kv, first, ctx_blocks, gen_blocks)
        _transfer(ctx_pools, gen_pool, req)
        reqs.append(req)
    return ctx_pools, gen_pool, reqs


def _decode(model, gen_pool, blocks, req: Request) -> list[int]:
    cache = lk.cache_from_pool(model, gen_pool, blocks, len(req.prompt))
    return lk.greedy_decode(model, cache, req.first, len(req.prompt), NEW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return lk.random_prompts(7, N_PROMPTS, 3, 70, 256, tokens_per_block=TPB)


def test_prompts_cover_block_boundaries(prompts) -> None:
    lengths = [len(p) for p in prompts]
    assert any(n < TPB for n in lengths)
    assert any(n % TPB == 0 for n in lengths)
    assert any(n > TPB and n % TPB for n in lengths)
    assert len(set(lengths)) == len(lengths)
    assert lk.random_prompts(7, N_PROMPTS, 3, 70, 256) == prompts


def test_weights_identical_across_processes() -> None:
    code = (
        "import importlib.util, sys; "
        f"s = importlib.util.spec_from_file_location('t', {str(Path(__file__))!r}); "
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
        "print(m._weights_digest('float32'), m._weights_digest('bfloat16'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # another thread setting, same bytes
    ).stdout.split()
    assert out == [_weights_digest("float32"), _weights_digest("bfloat16")]
    a, b = lk.build_model(seed=0), lk.build_model(seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_layout_and_pool_shape() -> None:
    model = lk.build_model(dtype=torch.bfloat16, num_kv_heads=2)
    assert lk.kv_layout_of(model, 16) == {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": "bfloat16",
        "tokens_per_block": 16,
    }
    pool = lk.alloc_pool(model, 5, kv_heads=1, tokens_per_block=16, device="cpu")
    assert len(pool) == 2
    assert all(t.shape == (5, 2, 16, 1, 16) and t.dtype == torch.bfloat16 for t in pool)
    assert all(not t.any() for t in pool)


def test_write_pool_leaves_unused_slots_and_rejects_short_block_lists() -> None:
    model = lk.build_model()
    kv, _ = lk.prefill(model, list(range(20)))  # 1 full block + 4 tokens
    pool = lk.alloc_pool(model, 3, kv_heads=2, tokens_per_block=TPB, device="cpu")
    for t in pool:
        t.fill_(7.0)
    lk.write_pool(pool, [2, 0], kv, head_lo=2, head_hi=4)
    k0 = kv[0][0][0]  # [H, S, D]
    assert torch.equal(pool[0][2, 0, 5], k0[2:4, 5])
    assert torch.equal(pool[0][0, 0, 3], k0[2:4, 19])
    assert (pool[0][0, :, 4:] == 7.0).all()  # the partial block's unused slots
    assert (pool[0][1] == 7.0).all()  # a block not handed out
    with pytest.raises(ValueError):
        lk.write_pool(pool, [2], kv, head_lo=2, head_hi=4)
    with pytest.raises(ValueError):
        lk.write_pool(pool, [2, 0], kv, head_lo=0, head_hi=4)


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads"),
    [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 2)],
    ids=["float32", "bfloat16", "float32-gqa"],
)
def test_split_path_is_token_exact(prompts, dtype, num_kv_heads) -> None:
    model = lk.build_model(dtype=dtype, num_kv_heads=num_kv_heads)
    _, gen_pool, reqs = _split_setup(model, prompts)
    for req in reqs:
        ref = lk.reference_generate(model, req.prompt, NEW)
        assert len(ref) == NEW
        cache = lk.cache_from_pool(model, gen_pool, req.gen_blocks, len(req.prompt))
        # The decode side holds the prefill forward's K/V bit for bit ...
        for layer, (k, v) in zip(cache.layers, req.kv, strict=True):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        # ... and decodes exactly what the monolithic generate does.
        tokens = lk.greedy_decode(model, cache, req.first, len(req.prompt), NEW)
        assert tokens == ref, f"prompt of {len(req.prompt)} tokens"


@pytest.fixture(scope="module")
def f32_split(prompts):
    model = lk.build_model()
    ctx_pools, gen_pool, reqs = _split_setup(model, prompts, seed=3)
    refs = [lk.reference_generate(model, r.prompt, NEW) for r in reqs]
    return model, ctx_pools, gen_pool, reqs, refs


def test_wrong_requests_blocks_change_the_tokens(f32_split) -> None:
    model, _, gen_pool, reqs, refs = f32_split
    by_len = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt))
    # Each request decoded from the next-longer request's blocks (enough tokens to fill).
    for a, b in zip(by_len, by_len[1:]):
        tokens = _decode(model, gen_pool, reqs[b].gen_blocks, reqs[a])
        assert tokens != refs[a], (len(reqs[a].prompt), len(reqs[b].prompt))


def test_swapped_head_halves_change_the_tokens(f32_split) -> None:
    model, ctx_pools, gen_pool, reqs, refs = f32_split
    pool = [t.clone() for t in gen_pool]
    for req, ref in zip(reqs, refs, strict=True):
        _transfer(ctx_pools, pool, req, swap_heads=True)
        assert _decode(model, pool, req.gen_blocks, req) != ref, len(req.prompt)


def test_a_corrupted_byte_region_changes_tokens_or_logits(f32_split) -> None:
    model, _, gen_pool, reqs, refs = f32_split
    g = torch.Generator().manual_seed(11)
    changed_tokens = 0
    for req, ref in zip(reqs, refs, strict=True):
        pool = [t.clone() for t in gen_pool]
        n = len(req.prompt)
        # 8 random bytes (two float32s) in one token's K or V of one layer.
        layer = int(torch.randint(len(pool), (1,), generator=g))
        tok = int(torch.randint(n, (1,), generator=g))
        kind = int(torch.randint(2, (1,), generator=g))
        row = pool[layer][req.gen_blocks[tok // TPB], kind, tok % TPB].view(-1)
        raw = row.view(torch.uint8)
        start = int(torch.randint(raw.numel() - 8, (1,), generator=g))
        before = raw[start : start + 8].clone()
        raw[start : start + 8] = torch.randint(256, (8,), generator=g, dtype=torch.uint8)
        assert not torch.equal(raw[start : start + 8], before)

        tokens = _decode(model, pool, req.gen_blocks, req)
        good = lk.decode_step(
            model, lk.cache_from_pool(model, gen_pool, req.gen_blocks, n), req.first, n
        )
        bad = lk.decode_step(
            model, lk.cache_from_pool(model, pool, req.gen_blocks, n), req.first, n
        )
        assert tokens != ref or not torch.equal(good, bad), n
        changed_tokens += tokens != ref
    assert changed_tokens > 0  # at least some corruptions show up in the tokens themselves


def test_stale_bytes_past_the_prompt_are_never_read(f32_split) -> None:
    """Garbage in the last block's unused slots (here: infinities) must not matter."""
    model, _, gen_pool, reqs, refs = f32_split
    partial = [i for i, r in enumerate(reqs) if len(r.prompt) % TPB]
    assert partial
    pool = [t.clone() for t in gen_pool]
    for i in partial:
        req = reqs[i]
        last = req.gen_blocks[len(req.prompt) // TPB]
        for t in pool:
            t[last, :, len(req.prompt) % TPB :] = float("inf")
        assert _decode(model, pool, req.gen_blocks, req) == refs[i]
