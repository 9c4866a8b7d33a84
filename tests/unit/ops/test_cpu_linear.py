"""The CPU linear methods against mmserve.ops.reference: the C++ kernel over float32 and
bfloat16 panels (every tile height, panel tails, odd K, strided rows, bias or none, both input
dtypes, random shapes) and oneDNN's packed float32 matmul, and the choice between them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve import host_cpu
from mmserve.ops import cpu, linear, reference
from mmserve.worker import kernel_plan

pytestmark = pytest.mark.usefixtures("parallel_threshold")

# 1-6 rows are one tile each; 7, 8, 13 split into smaller tiles; 49 and 100 cross a row chunk.
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 49, 100]


def strided_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, width] with a row stride of width + 5, as a slice of a wider activation is."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width + 5, generator=generator).to(dtype)[:, :width]


def bf16_tolerance(in_features: int) -> dict[str, float]:
    """One rounding to bfloat16 of float32 sums taken in another order: an ulp apart at most."""
    return {"rtol": 2**-7, "atol": 1e-5 * in_features}


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (16, 7), (17, 64), (40, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_reference_in_bfloat16(rows, out_features, in_features, with_bias):
    x = strided_rows(rows, in_features, torch.bfloat16, seed=rows)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    got = cpu.packed_linear(x, cpu.pack_weight(weight, torch.bfloat16), bias, out_features)
    want = reference.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, **bf16_tolerance(in_features))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (16, 7), (17, 64), (40, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_panels_match_reference_in_float32(rows, out_features, in_features, with_bias):
    x = strided_rows(rows, in_features, torch.float32, seed=rows)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(out_features) if with_bias else None
    packed = cpu.pack_weight(weight)
    assert packed.dtype == torch.float32
    got = cpu.packed_linear(x, packed, bias, out_features)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, reference.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_match_reference_on_random_shapes(seed, dtype):
    """M 1..16 (decode) or up to 300 (prefill), K and N anywhere up to a few hundred: K blocks,
    panel tails and row chunks at every offset."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=generator))
    rows = draw(1, 17) if seed % 2 == 0 else draw(17, 300)
    in_features, out_features = draw(1, 600), draw(1, 200)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if seed % 3 else None
    got = cpu.packed_linear(x, cpu.pack_weight(weight), bias, out_features)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, reference.linear(x, weight, bias), **bf16_tolerance(in_features))
        return
    # float32: within 1e-5 of the exact sum, relative to the sum of the terms' magnitudes (the
    # bound of any float32 summation order, which a plain rtol/atol misstates near zero).
    exact = reference.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = reference.linear(
        x.double().abs(), weight.double().abs(), None if bias is None else bias.double().abs()
    )
    assert ((got.double() - exact).abs() <= 1e-5 * magnitude + 1e-30).all()


@pytest.mark.parametrize("rows", [1, 6, 49])
def test_packed_linear_with_float32_rows_rounds_only_the_weight(rows):
    """float32 activations over a float32 weight: the packing rounds the weight to bfloat16,
    the sums stay float32 (to float32 accuracy against the rounded weight)."""
    x = strided_rows(rows, 96, torch.float32, seed=3)
    weight, bias = torch.randn(33, 96), torch.randn(33)
    got = cpu.packed_linear(x, cpu.pack_weight(weight, torch.bfloat16), bias, 33)
    want = reference.linear(x, weight.bfloat16().float(), bias)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    ("x_dtype", "packed_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_gated_linear_is_the_linear_then_silu_and_mul_bit_for_bit(seed, x_dtype, packed_dtype):
    """The SwiGLU applied inside the gate/up linear's tasks equals the two ops one after the
    other, exactly: decode and prefill row counts (row chunks), K blocks and odd K, strided rows,
    with and without bias; and it is the reference's SwiGLU to the dtype's resolution."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=generator))
    rows = draw(1, 17) if seed % 2 == 0 else draw(17, 120)
    in_features, width = draw(1, 600), 16 * draw(1, 12)
    x = strided_rows(rows, in_features, x_dtype, seed=seed)
    weight = torch.randn(2 * width, in_features, generator=generator).to(x_dtype)
    bias = torch.randn(2 * width, generator=generator).to(x_dtype) if seed % 3 else None
    packed = cpu.pack_weight(weight, packed_dtype)
    got = cpu.gated_packed_linear(x, packed, bias, 2 * width)
    assert got.dtype == x_dtype and got.shape == (rows, width)
    assert torch.equal(got, cpu.silu_and_mul(cpu.packed_linear(x, packed, bias, 2 * width)))
    want = reference.silu_and_mul(reference.linear(x, weight.to(packed_dtype).to(x_dtype), bias))
    if x_dtype == torch.bfloat16:  # gate and up each an ulp from the reference's, then the product
        torch.testing.assert_close(got, want, rtol=2**-5, atol=1e-4 * in_features)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features)


# Row counts around AMX's 16-row tiles and 32-row blocks (and a 48-row chunk's end), at K a
# multiple of 32: the tiles' path where the CPU has AMX (cpu.amx_tiles), vdpbf16ps elsewhere and
# with the tiles turned off (the amx_tiles fixture).
AMX_ROWS = [16, 17, 31, 32, 33, 47, 48, 49, 81, 130]


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("rows", AMX_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (40, 96), (200, 768)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_panels_at_tile_row_counts_match_reference(rows, out_features, in_features, with_bias):
    x = strided_rows(rows, in_features, torch.bfloat16, seed=rows)
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    got = cpu.packed_linear(x, cpu.pack_weight(weight, torch.bfloat16), bias, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, reference.linear(x, weight, bias), **bf16_tolerance(in_features))


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("rows", AMX_ROWS)
def test_gated_linear_at_tile_row_counts_is_the_linear_then_silu_and_mul(rows):
    x = strided_rows(rows, 96, torch.bfloat16, seed=rows)
    weight = torch.randn(2 * 48, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    packed = cpu.pack_weight(weight)
    got = cpu.gated_packed_linear(x, packed, None, 2 * 48)
    assert torch.equal(got, cpu.silu_and_mul(cpu.packed_linear(x, packed, None, 2 * 48)))
    want = reference.silu_and_mul(reference.linear(x, weight))
    torch.testing.assert_close(got, want, rtol=2**-5, atol=1e-4 * 96)


def test_amx_tiles_wherever_the_cpu_and_build_have_them():
    """An AVX512-BF16 build on a CPU with AMX-BF16 runs its bfloat16 prefill linears on AMX: the
    build adds the tile instructions and the process gets the tile registers from Linux."""

    assert cpu.amx_tiles() is (cpu.bf16_dot_products() and "amx_bf16" in host_cpu.flags().split())


def test_amx_tiles_turn_off_and_back_on():
    """`set_amx_tiles(False)` sends an AMX build's bfloat16 linears of 2 rows or more and its
    bfloat16 varlen attention to the vdpbf16ps kernels (they round otherwise, so the outputs tell
    which ran); True brings the tiles back, and it returns what was. Without AMX it changes
    nothing."""
    x = strided_rows(64, 96, torch.bfloat16, seed=1)
    packed = cpu.pack_weight(torch.randn(48, 96, generator=torch.Generator().manual_seed(2)).bfloat16())
    q, k, v = torch.randn(300, 3, 2, 64, generator=torch.Generator().manual_seed(3)).bfloat16().unbind(1)

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        return cpu.packed_linear(x, packed, None, 48), cpu.varlen_attention(q, k, v, [0, 300], 0.125)

    had_tiles = cpu.amx_tiles()
    before = outputs()
    assert cpu.set_amx_tiles(False) is had_tiles
    try:
        assert cpu.amx_tiles() is False
        off = outputs()
    finally:
        assert cpu.set_amx_tiles(True) is False
    assert cpu.amx_tiles() is had_tiles
    after = outputs()
    for was, now, out in zip(before, after, off):
        assert torch.equal(was, now)
        assert torch.equal(was, out) is (not had_tiles)


def test_gated_linear_keeps_leading_dimensions_and_refuses_a_width_off_the_panels():
    weight = torch.randn(64, 24).bfloat16()
    x = torch.randn(2, 3, 24).bfloat16()
    packed = cpu.pack_weight(weight)
    got = cpu.gated_packed_linear(x, packed, None, 64)
    assert got.shape == (2, 3, 32)
    assert torch.equal(got.reshape(6, 32), cpu.gated_packed_linear(x.reshape(6, 24), packed, None, 64))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.gated_packed_linear(x, cpu.pack_weight(torch.randn(48, 24).bfloat16()), None, 48)


def test_packed_linear_rejects_a_weight_packed_for_another_shape():
    packed = cpu.pack_weight(torch.randn(32, 8).bfloat16())
    with pytest.raises(RuntimeError, match="packed weight must be"):
        cpu.packed_linear(torch.randn(2, 9).bfloat16(), packed, None, 32)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        cpu.packed_linear(torch.randn(2, 8).bfloat16(), packed, None, 40)


def test_packed_bf16_method_keeps_leading_dimensions():
    weight = torch.randn(24, 32).bfloat16()
    method = linear.PanelLinear(weight)
    x = torch.randn(2, 3, 32).bfloat16()  # [batch, tokens, in]
    got = method(x)
    assert got.shape == (2, 3, 24)
    want = reference.linear(x.view(6, 32), weight).view(2, 3, 24)
    torch.testing.assert_close(got, want, **bf16_tolerance(32))
    assert method.weight_bytes == 2 * 32 * 32  # 24 columns padded to two panels of 16


@pytest.mark.skipif(not linear.onednn_supports(torch.float32), reason="oneDNN is not in this torch")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_onednn_method_matches_f_linear_in_float32(rows):
    weight, bias = torch.randn(48, 80), torch.randn(48)
    method = linear.OneDnnLinear(weight)
    x = strided_rows(rows, 80, torch.float32, seed=rows)
    torch.testing.assert_close(method(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert method(x).shape == (rows, 48)


def test_cpu_linear_method_chooses_by_dtype_and_row_counts():
    assert isinstance(
        kernel_plan.cpu_linear_method(torch.randn(8, 8, dtype=torch.float64)), linear.PlainLinear
    )
    fp32_decode = kernel_plan.cpu_linear_method(torch.randn(8, 8))
    fp32_large = kernel_plan.cpu_linear_method(torch.randn(8, 8), small_rows=False)
    bf16 = kernel_plan.cpu_linear_method(torch.randn(8, 8).bfloat16())
    onednn_fp32, onednn_bf16 = linear.onednn_supports(torch.float32), linear.onednn_supports(torch.bfloat16)
    assert isinstance(fp32_decode, linear.PanelLinear) and fp32_decode.packed.dtype == torch.float32
    assert isinstance(fp32_large, linear.OneDnnLinear if onednn_fp32 else linear.PlainLinear)
    pair_panels = kernel_plan.bf16_panels_lead()
    assert isinstance(bf16, linear.OneDnnLinear if onednn_bf16 and not pair_panels else linear.PanelLinear)
    bf16_large = kernel_plan.cpu_linear_method(torch.randn(8, 8).bfloat16(), small_rows=False)
    assert isinstance(bf16_large, linear.OneDnnLinear if onednn_bf16 else linear.PanelLinear)


@pytest.mark.parametrize(
    ("vendor", "flags", "widens"),
    [
        ("GenuineIntel", "avx2 avx512f avx512_bf16", True),  # Cooper Lake, Emerald Rapids without AMX
        ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16", False),  # AMX: bf16 is the fast path
        ("AuthenticAMD", "avx2 avx512f avx512_bf16", False),  # Zen 4: bf16 dot at twice float32
        ("AuthenticAMD", "avx2 fma", False),  # no bf16 hardware: the towers stay as loaded
    ],
)
def test_float32_tower_only_where_bf16_dot_products_are_slow(monkeypatch, vendor, flags, widens):

    monkeypatch.setenv("MMSERVE_CPU_WIDEN_BF16", "auto")
    monkeypatch.setattr(host_cpu, "vendor", lambda: vendor)
    monkeypatch.setattr(host_cpu, "flags", lambda: flags)
    assert kernel_plan.float32_outruns_bfloat16.__wrapped__() is widens


@pytest.mark.parametrize(
    ("flags", "leads"), [("avx512f avx512_bf16", True), ("avx512f avx512_bf16 amx_bf16", False)]
)
def test_bf16_dot_products_lead_only_without_amx(monkeypatch, flags, leads):
    """Zen 4 (no AMX): the language model's bf16 linears on K-pair panels and bf16 vision
    attention on csrc's vdpbf16ps kernel, where the build has it."""

    monkeypatch.setattr(host_cpu, "flags", lambda: flags)
    assert kernel_plan.bf16_dot_products_lead.__wrapped__() is (leads and cpu.bf16_dot_products())


def test_widening_bf16_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MMSERVE_CPU_WIDEN_BF16", "never")
    assert kernel_plan.float32_outruns_bfloat16.__wrapped__() is False
    monkeypatch.setenv("MMSERVE_CPU_WIDEN_BF16", "sometimes")
    with pytest.raises(ValueError, match="MMSERVE_CPU_WIDEN_BF16"):
        kernel_plan.float32_outruns_bfloat16.__wrapped__()


def test_the_parallel_threshold_is_set_returned_and_never_negative():
    before = cpu.set_min_parallel_work(123)
    assert cpu.set_min_parallel_work(before) == 123
    with pytest.raises(RuntimeError, match="must be >= 0"):
        cpu.set_min_parallel_work(-1)
    assert cpu.set_min_parallel_work(before) == before
