"""The C++ fused decoder layer against mmserve.ops.reference.decoder_layer.

Random mixed steps (decode rows, whole prompts, prompt chunks, idle requests) over block tables
with holes, from the paged attention tests; random widths, GQA ratios and head dims, with and
without a q/k/v bias, Qwen3's per-head q/k norms and an incoming residual; each linear weight
packed into csrc's panels or into oneDNN's layout (where oneDNN computes the dtype: float32
everywhere, bfloat16 with AVX512-BF16 / AMX), chosen at random. The layer's output, the stream it
returns and the keys and values it writes into the cache are all compared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cpu_paged_attention import FP32_TOLERANCE, random_step

from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.ops import cpu, reference
from mmserve.ops.linear import OneDnnLinear, onednn_supports

pytestmark = pytest.mark.usefixtures("parallel_threshold")

MAX_POSITIONS = 512


def slots_of_queries(step) -> torch.Tensor:
    """[T] int64: the cache slot of each query row (the last positions of its request's context)."""
    block_size = step.kv_cache.shape[2]
    slots = []
    starts = step.query_start_loc.tolist()
    for r, context in enumerate(step.seq_lens.tolist()):
        for position in range(context - (starts[r + 1] - starts[r]), context):
            block = int(step.block_table[r, position // block_size])
            slots.append(block * block_size + position % block_size)
    return torch.tensor(slots, dtype=torch.int64)


def random_layer(rng: np.random.Generator, dtype: torch.dtype) -> dict:
    heads = [(4, 4), (6, 2), (8, 1), (4, 2)][rng.integers(4)]
    head_dim = int(rng.choice([32, 64, 128]))
    hidden, intermediate = int(rng.choice([64, 96, 160])), int(rng.choice([96, 200]))
    num_heads, num_kv_heads = heads
    qkv_out = (num_heads + 2 * num_kv_heads) * head_dim
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 31)))

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    quarter = head_dim // 8
    return {
        "heads": heads,
        "head_dim": head_dim,
        "hidden": hidden,
        "weights": [
            1 + randn(hidden, scale=0.1),
            randn(qkv_out, hidden, scale=hidden**-0.5),
            randn(hidden, num_heads * head_dim, scale=(num_heads * head_dim) ** -0.5),
            1 + randn(hidden, scale=0.1),
            randn(2 * intermediate, hidden, scale=hidden**-0.5),
            randn(hidden, intermediate, scale=intermediate**-0.5),
        ],
        "qkv_bias": randn(qkv_out, scale=0.1) if rng.random() < 0.5 else None,
        "qk_norms": [1 + randn(head_dim, scale=0.1) for _ in range(2)] if rng.random() < 0.5 else [],
        "rotary": MRotaryEmbedding(
            head_dim, 10000.0, [head_dim // 2 - 2 * quarter, quarter, quarter], MAX_POSITIONS
        ),
    }


def packed_at_random(weights: list[torch.Tensor], rng: np.random.Generator) -> list[torch.Tensor]:
    """Norm weights as they are; each linear weight as panels or, where it runs, oneDNN's copy."""
    onednn = onednn_supports(weights[0].dtype)
    return [
        w if w.dim() == 1 else OneDnnLinear(w).packed if onednn and rng.random() < 0.5 else cpu.pack_weight(w)
        for w in weights
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(12))
def test_decoder_layer_matches_reference(dtype, seed):
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, dtype)
    step = random_step(rng, layer["heads"], layer["head_dim"], block_size=16, dtype=dtype)
    num_tokens = step.query.shape[0]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, layer["hidden"], generator=generator).to(dtype)
    residual = torch.randn(num_tokens, layer["hidden"], generator=generator).to(dtype) if seed % 3 else None
    positions = torch.randint(0, MAX_POSITIONS, (3, num_tokens), generator=generator)
    rotary = layer["rotary"]
    shared = dict(
        positions=positions,
        query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens,
        block_table=step.block_table,
        slot_mapping=slots_of_queries(step),
        qkv_bias=layer["qkv_bias"],
        qk_norms=layer["qk_norms"],
        cos_cache=rotary.cos_cache,
        sin_cache=rotary.sin_cache,
        row_of_channel=rotary.section_of_channel,
        num_heads=layer["heads"][0],
        num_kv_heads=layer["heads"][1],
        eps=1e-6,
        scale=layer["head_dim"] ** -0.5,
    )
    plain = layer["weights"]
    packed = packed_at_random(plain, np.random.default_rng(1000 + seed))
    want_cache, got_cache = step.kv_cache.clone(), step.kv_cache.clone()

    def stream() -> torch.Tensor | None:
        return None if residual is None else residual.clone()

    want, want_stream = reference.decoder_layer(
        x.clone(), stream(), kv_cache=want_cache, weights=plain, **shared
    )
    got, got_stream = cpu.decoder_layer(x.clone(), stream(), kv_cache=got_cache, weights=packed, **shared)
    assert got.shape == want.shape == (num_tokens, layer["hidden"]) and got.dtype == dtype
    if dtype == torch.float32:
        for got_tensor, want_tensor in [(got_cache, want_cache), (got_stream, want_stream), (got, want)]:
            torch.testing.assert_close(got_tensor, want_tensor, **FP32_TOLERANCE)
        return
    # Both sides round the intermediates (q/k/v, attention, norms) at the same points, but a value
    # one bfloat16 ulp apart there moves every later sum (and rotary mixes a key's channels, so a
    # small one takes a large one's ulp): one ulp of each tensor's scale.
    for got_tensor, want_tensor in [(got_cache, want_cache), (got_stream, want_stream), (got, want)]:
        scale = want_tensor.float().abs().max().item()
        torch.testing.assert_close(got_tensor, want_tensor, rtol=2**-7, atol=2**-7 * scale)


def test_decoder_layer_overwrites_its_inputs_as_documented():
    """With a residual, the returned stream is that tensor; without one, it is x itself."""
    rng = np.random.default_rng(100)
    layer = random_layer(rng, torch.float32)
    step = random_step(rng, layer["heads"], layer["head_dim"], block_size=16, dtype=torch.float32)
    num_tokens = step.query.shape[0]
    rotary = layer["rotary"]
    args = (
        torch.zeros(3, num_tokens, dtype=torch.int64), step.kv_cache, step.query_start_loc, step.seq_lens,
        step.block_table, slots_of_queries(step),
        [w if w.dim() == 1 else cpu.pack_weight(w) for w in layer["weights"]], layer["qkv_bias"],
        layer["qk_norms"], rotary.cos_cache, rotary.sin_cache, rotary.section_of_channel, *layer["heads"],
        1e-6, layer["head_dim"] ** -0.5,
    )  # fmt: skip
    x, residual = torch.randn(num_tokens, layer["hidden"]), torch.randn(num_tokens, layer["hidden"])
    _, stream = cpu.decoder_layer(x, residual, *args)
    assert stream is residual
    x = torch.randn(num_tokens, layer["hidden"])
    _, stream = cpu.decoder_layer(x, None, *args)
    assert stream is x


def test_decoder_layer_refuses_a_wrong_weight_count():
    with pytest.raises(RuntimeError, match="decoder_layer takes 6 weights"):
        cpu.decoder_layer(
            torch.zeros(1, 8), None, torch.zeros(3, 1, dtype=torch.int64), torch.zeros(2, 1, 16, 1, 8),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), [torch.ones(8)],
            None, [], torch.ones(4, 4), torch.zeros(4, 4), torch.zeros(4, dtype=torch.int64), 1, 1, 1e-6, 1.0,
        )  # fmt: skip
