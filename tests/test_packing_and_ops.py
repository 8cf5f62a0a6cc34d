"""GPTQ-layout packing is exact, and qc.quant_linear equals dequantize-then-matmul."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.algorithms.packing import pack_cols, pack_rows, unpack_cols, unpack_rows
from qcompiler.layouts.gptq import dequantize_gptq, pack_gptq


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), words=st.integers(1, 4), cols=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_pack_unpack_roundtrip(bits, words, cols, seed):
    n = words * 32  # every bit width fills whole words at multiples of 32 values
    codes = torch.randint(0, 2**bits, (n, cols), generator=torch.Generator().manual_seed(seed))
    packed = pack_rows(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (n * bits // 32, cols)
    assert torch.equal(unpack_rows(packed, bits, n), codes.int())
    assert torch.equal(unpack_cols(pack_cols(codes.t(), bits), bits, n), codes.t().int())


def test_4bit_matches_gptq_reference_packing():
    codes = torch.randint(0, 16, (16, 5))
    expected = torch.zeros(2, 5, dtype=torch.int64)
    for r in range(16):  # GPTQ: row r goes to word r // 8 at bit offset 4 * (r % 8)
        expected[r // 8] |= codes[r].long() << (4 * (r % 8))
    expected = torch.where(expected >= 2**31, expected - 2**32, expected).int()
    assert torch.equal(pack_rows(codes, 4), expected)


def test_3bit_values_straddle_words():
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[10] = 0b111  # bits 30..32: two bits in word 0, one bit in word 1
    packed = pack_rows(codes, 3)
    assert packed.shape == (3, 1)
    assert (packed[0].item() & 0xFFFFFFFF) >> 30 == 0b11 and packed[1].item() & 1 == 1


def test_bad_packing_inputs_are_named():
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_rows(torch.zeros(32, 1, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="whole int32 words"):
        pack_rows(torch.zeros(20, 1, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="codes must lie"):
        pack_rows(torch.full((32, 1), 16), 4)


@pytest.mark.parametrize("bits,group", [(2, 32), (3, 64), (4, -1), (8, 32), (4, 48)])
def test_quant_linear_equals_dequantize_then_matmul(bits, group):
    gen = torch.Generator().manual_seed(bits)
    n_out, n_in = 32, 192
    n_groups = 1 if group == -1 else -(-n_in // group)
    codes = torch.randint(0, 2**bits, (n_out, n_in), generator=gen)
    scales = torch.rand(n_groups, n_out, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 2**bits, (n_groups, n_out), generator=gen).float()
    g_idx = torch.zeros(n_in, dtype=torch.int32) if group == -1 else torch.arange(n_in) // group
    g_idx = g_idx[torch.randperm(n_in, generator=gen)]  # act-order style scattered groups
    w = pack_gptq(codes, scales, zeros, g_idx, bits, group)
    W = dequantize_gptq(w.qweight, w.qzeros, w.scales, w.g_idx, bits)
    expected_W = (codes.float() - zeros.t()[:, g_idx.long()]) * scales.half().float().t()[:, g_idx.long()]
    assert torch.equal(W, expected_W)
    x = torch.randn(3, 5, n_in, generator=gen)
    bias = torch.randn(n_out, generator=gen)
    y = torch.ops.qc.quant_linear(x, w.qweight, w.qzeros, w.scales, w.g_idx, bias, bits, group)
    assert torch.allclose(y, x @ expected_W.t() + bias, atol=1e-5)


def test_quant_linear_fake_impl_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = pack_gptq(
        torch.zeros(16, 64, dtype=torch.int64),
        torch.ones(1, 16),
        torch.zeros(1, 16),
        torch.zeros(64, dtype=torch.int32),
        4,
        -1,
    )
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.qc.quant_linear(torch.empty(2, 7, 64), w.qweight, w.qzeros, w.scales, w.g_idx, None, 4, -1)
    assert tuple(y.shape) == (2, 7, 16)
