"""Quantized embedding tables through ONNX Runtime (backends/onnx_embedding.py): GatherBlockQuantized
over the table's MatMulNBits bytes gives the graph's logits, a tied head's MatMulNBits and the lookup
share one stored table, act-order columns come back in order, and a group no block tiles is exported
as an fp32 table with a note."""

from __future__ import annotations

import onnx
import pytest
import torch
from causal_lms import calibration, prompt
from test_quantized_embeddings import _llama

import qcompiler as qc
from qcompiler.algorithms.gptq import gptq_quantize
from qcompiler.backends.onnx_embedding import gather_block_quantized
from qcompiler.backends.onnx_nbits import block_zero_codes, gptq_to_nbits
from qcompiler.layouts.gptq import pack_gptq
from qcompiler.layouts.gptq_embedding import reference_embedding


def _initializer_sizes(path) -> dict[str, tuple]:
    proto = onnx.load(str(path))
    return {t.name: tuple(t.dims) for t in proto.graph.initializer}


SLOW = pytest.mark.slow  # the default run keeps the tied 4-bit table (the shared initializer)


@pytest.mark.parametrize(
    "tied,bits,group",
    [
        (True, 4, 32),
        pytest.param(False, 3, 16, marks=SLOW),
        pytest.param(True, 8, -1, marks=SLOW),
        pytest.param(True, 2, 64, marks=SLOW),
    ],
)
def test_onnxruntime_runs_a_quantized_table_with_the_graphs_logits(tmp_path, tied, bits, group):
    """Logits within float32 rounding of the graph's (1e-5 of the largest); a tied table is stored
    once (one uint8 table the size of its codes, no float copy of it)."""
    model = _llama(tied=tied, vocab=512)
    ids = prompt(2, 12, seed=3) % 512
    recipe = [qc.passes.QuantizeEmbeddings(bits=bits, group_size=group), qc.passes.GPTQ(bits=4, group_size=32)]
    cm = qc.compile(model, {"input_ids": ids}, recipe=recipe, calibration=calibration(), progress=False)
    with torch.no_grad():
        want = cm(input_ids=ids).logits
        got = cm.with_backend("onnxruntime", accuracy_level=0, path=tmp_path / "m.onnx")(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    sizes = _initializer_sizes(tmp_path / "m.onnx")
    tables = [name for name, dims in sizes.items() if dims and dims[0] == 512]
    code_bytes = 512 * 64 * (4 if bits == 3 else bits) // 8
    packed = [n for n in tables if len(sizes[n]) == 3 and sizes[n][1] * sizes[n][2] * 512 >= code_bytes]
    assert len(packed) == 1, tables
    assert not [n for n in tables if sizes[n] == (512, 64)]  # no float table
    if not tied:  # the untied head stays a float MatMul: its [64, 512] weight is there
        assert any(dims == (64, 512) for dims in sizes.values())


def test_act_order_columns_come_back_in_order():
    """A table whose groups are not contiguous (act-order without static groups) is re-packed in
    processing order; the lookup gathers its columns back: equal to the stored table's rows."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(48, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) * torch.linspace(0.1, 3, 64)
    res = gptq_quantize(table, x.t() @ x, bits=4, group_size=16, act_order=True, static_groups=False)
    packed = pack_gptq(res.codes, res.scales, res.zeros, res.g_idx, 4, 16)
    stored = (packed.qweight, packed.qzeros, packed.scales, packed.g_idx)
    tensors, perm, k, n, bits, block = gptq_to_nbits(*stored, 4, 16)
    assert perm is not None
    blocks = tensors["B"].shape[1]
    ids = torch.tensor([[3, 0, 47], [5, 5, 1]])
    got = gather_block_quantized(
        ids,
        tensors["B"],
        tensors["scales"].reshape(n, blocks, 1),
        block_zero_codes(tensors["zero_points"], n, blocks, bits).to(torch.uint8).reshape(n, blocks, 1),
        torch.argsort(perm),
        k,
        bits,
        block,
    )
    assert torch.allclose(got, reference_embedding(*stored, 4, ids), rtol=0, atol=1e-6)


@SLOW
def test_a_group_no_block_tiles_exports_a_float_table_with_a_note(tmp_path):
    model = _llama(tied=False, vocab=512)
    ids = prompt(2, 12, seed=3) % 512
    cm = qc.compile(
        model, {"input_ids": ids}, recipe=[qc.passes.QuantizeEmbeddings(bits=4, group_size=24)], progress=False
    )
    with torch.no_grad():
        want = cm(input_ids=ids).logits
        got = cm.with_backend("onnxruntime", accuracy_level=0, path=tmp_path / "m.onnx")(input_ids=ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    notes = {p.key: p.value for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}["qcompiler.notes"]
    assert "model.embed_tokens: group size 24 has no GatherBlockQuantized block size" in notes
