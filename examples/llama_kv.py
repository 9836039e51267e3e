"""The model half of the disaggregated-generation example: a tiny Llama and its KV cache in pages.

`examples/disagg_generate.py` runs a prefill server at tensor-parallel 2 and a decode
server at tp=1. This module holds everything that example needs from the model side,
in pure torch + transformers (5.x) and without kvhandoff:

* `build_model` makes a small `LlamaForCausalLM` with seeded random weights, so every
  process (prefill ranks, decode rank, the checking driver) builds the *same* model
  without a download or a shared file.
* `prefill` runs the prompt once and returns the per-layer K/V plus the first token.
* `write_pool` stores one head shard of that K/V into a paged pool in the vLLM layout
  `[num_blocks, 2, tokens_per_block, kv_heads, head_dim]`, which is what a prefill rank
  of a tensor-parallel server holds: rank r of tp keeps KV heads [r*H/tp, (r+1)*H/tp).
* (the transfer library copies the blocks' bytes into the decode server's pool)
* `cache_from_pool` turns the decode side's pool back into a transformers
  `DynamicCache`, and `greedy_decode` continues from it.
* `reference_generate` is the monolithic `model.generate(..., do_sample=False)`; the split
  path must reproduce its tokens exactly.

Exactness is by construction, not by tolerance: the decode side's cache holds the very
bytes the prefill forward produced, and `prefill`/`greedy_decode` call the model with
the same arguments `generate` uses (a 2-D all-ones attention mask, `logits_to_keep=1`),
so each step computes the same floating-point operations on the same inputs. Any
difference in a single byte of the transferred KV can therefore change the output, and
the tests check that it does.

The cached K is *after* rotary embedding (transformers applies RoPE before
`cache.update`), as in vLLM's pool, so positions are baked into the transferred bytes and
the decode side must feed its next token at position `prompt_len`.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence

# Building from a config never needs the hub; make sure nothing below tries to reach it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

# One layer's past: (K, V), each [batch=1, num_kv_heads, seq_len, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def build_model(
    seed: int = 0,
    *,
    num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 4, head_dim: int = 16,
    vocab_size: int = 256, intermediate_size: int = 128,
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A small Llama with seeded random weights, in eval mode.

    Every parameter is drawn from a private `torch.Generator` seeded with `seed`, in
    sorted parameter-name order, in float32 on the CPU, and only then cast and moved.
    That makes the weights a function of the arguments alone: independent of the
    global RNG state, of transformers' own init scheme, and of the device, so two
    processes (a prefill rank and a decode rank) get bit-identical weights.

    The scale is chosen so the model is *sharp* rather than near-uniform: linear
    weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1). With transformers' default
    std=0.02 a tiny model's logits are nearly flat and greedy decoding tends to repeat
    one token whatever the context, which would let a wrong KV cache go unnoticed.

    There is no eos/bos/pad in the config, so `generate` never stops early (see
    `reference_generate`).
    """
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name in sorted(params):
            p = params[name]
            if p.ndim == 1:  # RMSNorm gains: around 1 so the residual stream stays O(1)
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            else:  # nn.Linear weight [out, in]
                w = torch.randn(p.shape, generator=gen, dtype=torch.float32) / math.sqrt(p.shape[1])
            p.copy_(w)
    model = model.to(device=device, dtype=dtype)
    model.generation_config.pad_token_id = 0  # only silences generate's pad warning
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.eval()
    return model


def kv_layout_of(model: LlamaForCausalLM, tokens_per_block: int = 16) -> dict[str, object]:
    """The KV layout of `model` as a plain dict, to describe the pools to a transfer library.

    A plain dict (not a config object) because it crosses process and library
    boundaries; the dtype is a name ("float32", "bfloat16", "float16") for the same reason.
    """
    cfg = model.config
    return {
        "num_layers": int(cfg.num_hidden_layers),
        "num_kv_heads": int(cfg.num_key_value_heads),
        "head_dim": int(_head_dim(model)),
        "dtype": _DTYPE_NAMES[model.dtype],
        "tokens_per_block": int(tokens_per_block),
    }


def alloc_pool(
    model: LlamaForCausalLM,
    num_blocks: int,
    *,
    kv_heads: int,
    tokens_per_block: int,
    device: str | torch.device,
) -> list[torch.Tensor]:
    """A zeroed paged KV pool: one tensor per layer, `[num_blocks, 2, T, kv_heads, head_dim]`.

    This is vLLM's layout (index 0 of dim 1 is K, 1 is V). A block is contiguous in
    memory, so a transfer library can move a request's KV as one region per block and
    layer. `kv_heads` is the number of heads *this rank* holds: H/tp on a prefill rank,
    H on the tp=1 decode rank.
    """
    shape = (num_blocks, 2, tokens_per_block, kv_heads, _head_dim(model))
    return [
        torch.zeros(shape, dtype=model.dtype, device=device)
        for _ in range(model.config.num_hidden_layers)
    ]


@torch.no_grad()
def prefill(model: LlamaForCausalLM, prompt_ids: Sequence[int]) -> tuple[list[LayerKV], int]:
    """One forward over the prompt; returns the per-layer K/V and the first generated token.

    The call mirrors `generate`'s first step (all-ones 2-D attention mask,
    `logits_to_keep=1`), so the K/V and the logits are bit-identical to what
    `generate` computes; the first token is the argmax of the last position's logits,
    which is what greedy `generate` picks first. Each returned K/V tensor is
    `[1, num_kv_heads, len(prompt_ids), head_dim]`, K after rotary embedding.
    """
    device = model.device
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out = model(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        cache=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    kv = [(layer.keys, layer.values) for layer in out.cache.layers]
    first_token = int(out.logits[0, -1].argmax())
    return kv, first_token


@torch.no_grad()
def write_pool(
    pool: Sequence[torch.Tensor],
    blocks: Sequence[int],
    kv: Sequence[LayerKV],
    *,
    head_lo: int,
    head_hi: int,
) -> None:
    """Write KV heads [head_lo, head_hi) of every layer into `pool`'s `blocks`, in order.

    Block `blocks[j]` receives the prompt's tokens [j*T, (j+1)*T); the last block may be
    partial and its unused slots are left untouched (a pool is reused, so they may hold
    another request's stale bytes; nothing reads them because `cache_from_pool` is told
    the token count). The heads land as the pool's local heads 0..head_hi-head_lo-1,
    which is what prefill rank r of tp keeps: heads [r*H/tp, (r+1)*H/tp).

    Raises ValueError if there are too few blocks or the head range does not match the
    pool's head dimension, rather than silently dropping tokens.
    """
    if len(pool) != len(kv):
        raise ValueError(f"pool has {len(pool)} layers, kv has {len(kv)}")
    num_tokens = kv[0][0].shape[2]
    tpb = pool[0].shape[2]
    needed = -(-num_tokens // tpb)
    if len(blocks) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {tpb}, got {len(blocks)}")
    if head_hi - head_lo != pool[0].shape[3]:
        raise ValueError(
            f"heads [{head_lo}, {head_hi}) do not fit a pool of {pool[0].shape[3]} heads"
        )
    for layer_pool, (k, v) in zip(pool, kv, strict=True):
        # [1, H, S, D] -> [S, h, D], the pool's per-token row order.
        k_tok = k[0, head_lo:head_hi].transpose(0, 1)
        v_tok = v[0, head_lo:head_hi].transpose(0, 1)
        for j in range(needed):
            lo, hi = j * tpb, min((j + 1) * tpb, num_tokens)
            layer_pool[blocks[j], 0, : hi - lo] = k_tok[lo:hi]
            layer_pool[blocks[j], 1, : hi - lo] = v_tok[lo:hi]


@torch.no_grad()
def cache_from_pool(
    model: LlamaForCausalLM,
    pool: Sequence[torch.Tensor],
    blocks: Sequence[int],
    num_tokens: int,
) -> DynamicCache:
    """A `DynamicCache` holding exactly the pool's K/V for the first `num_tokens` tokens.

    The blocks are gathered in order, trimmed to `num_tokens` and permuted back to
    transformers' `[1, kv_heads, seq, head_dim]`. The tensors are fresh contiguous
    copies, so decoding (which grows the cache by concatenation) never writes into the
    pool. transformers 5.x fills a cache through the constructor's `ddp_cache_data`
    (an iterable of per-layer (K, V)); passing `config` makes the layer types follow the
    model (all full-attention `DynamicLayer`s for Llama), as `generate` does.
    """
    tpb = pool[0].shape[2]
    needed = -(-num_tokens // tpb)
    if len(blocks) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {tpb}, got {len(blocks)}")
    index = torch.tensor(list(blocks[:needed]), dtype=torch.long, device=pool[0].device)
    layers = []
    for layer_pool in pool:
        sel = layer_pool.index_select(0, index)  # [n, 2, T, h, D]
        k = sel[:, 0].flatten(0, 1)[:num_tokens]  # [S, h, D]
        v = sel[:, 1].flatten(0, 1)[:num_tokens]
        layers.append(
            (
                k.permute(1, 0, 2).unsqueeze(0).contiguous(),
                v.permute(1, 0, 2).unsqueeze(0).contiguous(),
            )
        )
    cache = DynamicCache(layers, config=model.config)
    if cache.get_seq_length() != num_tokens:  # guards against an API change that drops data
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens, expected {num_tokens}")
    return cache


@torch.no_grad()
def decode_step(model: LlamaForCausalLM, cache: DynamicCache, token: int, pos: int) -> torch.Tensor:
    """Feed `token` at position `pos`; returns the next-token logits `[vocab]`, extends `cache`.

    The call is the one `generate` makes per decode step: a 2-D all-ones attention mask
    over the `pos + 1` tokens so far and `logits_to_keep=1`. Matching the arguments, not
    just the maths, leaves nothing to chance: a different mask form or a full-sequence
    lm_head may pick a different kernel that rounds differently. (On CPU with this tiny
    model, dropping the mask or `logits_to_keep` happened not to change any bit; the
    example also runs on GPUs, where kernel choice depends on such details.)
    """
    device = model.device
    out = model(
        input_ids=torch.tensor([[token]], dtype=torch.long, device=device),
        attention_mask=torch.ones((1, pos + 1), dtype=torch.long, device=device),
        position_ids=torch.tensor([[pos]], dtype=torch.long, device=device),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[0, -1]


@torch.no_grad()
def greedy_decode(
    model: LlamaForCausalLM,
    cache: DynamicCache,
    first_token: int,
    prompt_len: int,
    max_new_tokens: int,
) -> list[int]:
    """Greedy decoding from a rebuilt cache; returns `max_new_tokens` tokens, `first_token` first.

    Token i (i >= 1) is the argmax of `decode_step` fed token i-1 at position
    `prompt_len + i - 1`, so the logits are bit-identical to `generate`'s when the cache
    is. The model has no eos token, so like `reference_generate` this never stops
    early. `cache` is extended in place.
    """
    if cache.get_seq_length() != prompt_len:
        raise ValueError(f"cache holds {cache.get_seq_length()} tokens, prompt has {prompt_len}")
    tokens = [int(first_token)]
    while len(tokens) < max_new_tokens:
        logits = decode_step(model, cache, tokens[-1], prompt_len + len(tokens) - 1)
        tokens.append(int(logits.argmax()))
    return tokens[:max_new_tokens]


@torch.no_grad()
def reference_generate(
    model: LlamaForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int
) -> list[int]:
    """The monolithic answer: `model.generate(..., do_sample=False)`'s new tokens.

    No eos (so it never stops early: exactly `max_new_tokens` tokens), a pad token set
    only to keep `generate` from warning, and no length limit other than
    `max_new_tokens`.
    """
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, input_ids.shape[1] :]]


def random_prompts(
    seed: int,
    n: int,
    min_len: int,
    max_len: int,
    vocab_size: int,
    *,
    tokens_per_block: int = 16,
) -> list[list[int]]:
    """`n` random prompts whose lengths cover the block-boundary cases.

    Lengths cycle through three kinds, each in [min_len, max_len] where possible:
    shorter than one block, an exact multiple of `tokens_per_block` (the last block
    full), and a longer non-multiple (the last block partial). Lengths are distinct
    while the range allows, so the prompts also exercise different block counts.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    T = tokens_per_block
    span = range(min_len, max_len + 1)
    kinds = [
        [n_ for n_ in span if n_ < T],
        [n_ for n_ in span if n_ % T == 0],
        [n_ for n_ in span if n_ > T and n_ % T != 0],
    ]
    kinds = [k for k in kinds if k] or [list(span)]
    for k in kinds:
        rng.shuffle(k)
    lengths: list[int] = []
    for i in range(n):
        pool = kinds[i % len(kinds)]
        fresh = [x for x in pool if x not in lengths]
        lengths.append(fresh[0] if fresh else rng.choice(pool))
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in lengths]


def _head_dim(model: LlamaForCausalLM) -> int:
    cfg = model.config
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _main() -> None:
    """`python examples/llama_kv.py`: time prefill + a 16-token decode per prompt, and check it."""
    import statistics
    import time

    tpb, new = 16, 16
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(dtype=dtype)
        prompts = random_prompts(0, 10, 3, 70, model.config.vocab_size, tokens_per_block=tpb)
        reference_generate(model, prompts[0], 2)  # warm-up: first calls pay one-off setup
        split_ms, ref_ms = [], []
        for prompt in prompts:
            t0 = time.perf_counter()
            kv, first = prefill(model, prompt)
            blocks = list(range(-(-len(prompt) // tpb)))
            pool = alloc_pool(
                model,
                len(blocks),
                kv_heads=model.config.num_key_value_heads,
                tokens_per_block=tpb,
                device="cpu",
            )
            write_pool(pool, blocks, kv, head_lo=0, head_hi=model.config.num_key_value_heads)
            tokens = greedy_decode(
                model, cache_from_pool(model, pool, blocks, len(prompt)), first, len(prompt), new
            )
            t1 = time.perf_counter()
            ref = reference_generate(model, prompt, new)
            t2 = time.perf_counter()
            assert tokens == ref, (len(prompt), tokens, ref)
            split_ms.append((t1 - t0) * 1e3)
            ref_ms.append((t2 - t1) * 1e3)
        print(
            f"{_DTYPE_NAMES[dtype]:>9}: prefill+pool+{new}-token decode per prompt "
            f"median {statistics.median(split_ms):.1f} ms (max {max(split_ms):.1f}); "
            f"generate median {statistics.median(ref_ms):.1f} ms; "
            f"torch threads {torch.get_num_threads()}"
        )


if __name__ == "__main__":
    _main()
