"""The ``qc`` op contract lives in one place: every op has a spec, and nothing outside the
registry reads a node's arguments by position."""

import re
from pathlib import Path

import pytest
import torch

import qcompiler.backends.onnx_attention  # noqa: F401  (defines export-only ops)
import qcompiler.backends.onnx_layout  # noqa: F401
from qcompiler.ir.op_registry import args_of, call_op, registered, spec
from qcompiler.layouts.gptq import pack_gptq

ROOT = Path(__file__).resolve().parents[1]

# Files that pattern-match aten / transformers graphs (never qc ops) may index node arguments.
ATEN_MATCHERS = {
    "qcompiler/ir/graph.py",
    "qcompiler/pipeline/smoothing_plan.py",
    "qcompiler/ir/experts.py",
    "passes/lower_int8.py",
    "qcompiler/pipeline/residual_stream.py",
    "qcompiler/pipeline/value_heads.py",
    "backends/onnx_attention.py",
    "passes/fp8_kv_cache.py",
    "passes/embeddings.py",  # aten.embedding's table and ids
}


def _sources():
    for folder in ("qcompiler", "passes", "backends", "kernels"):
        yield from (ROOT / folder).rglob("*.py")


def test_no_positional_argument_access_outside_the_registry():
    offenders = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ATEN_MATCHERS or rel == "qcompiler/ir/op_registry.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<!exc)\.args\[", line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "read qc node arguments by name (op_registry.args_of):\n" + "\n".join(offenders)


def test_every_defined_qc_op_has_a_spec():
    defined = {m for path in _sources() for m in re.findall(r'custom_op\("qc::(\w+)"', path.read_text())}
    assert defined and defined <= set(registered()), f"ops without a spec: {sorted(defined - set(registered()))}"


def _quant_linear_graph():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (8, 32))
    packed = pack_gptq(
        codes, torch.rand(1, 8) + 0.1, torch.full((1, 8), 8.0), torch.zeros(32, dtype=torch.int32), 4, -1
    )
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        gm.register_buffer(f"layer_{name}", getattr(packed, name))
    graph = gm.graph
    x = graph.placeholder("x")
    attrs = {name: graph.get_attr(f"layer_{name}") for name in ("qweight", "qzeros", "scales", "g_idx")}
    node = call_op(graph, "quant_linear", x=x, **attrs, bits=4, group_size=-1)
    graph.output(node)
    gm.recompile()
    return gm, node, packed


def test_call_op_orders_arguments_by_schema_and_args_of_reads_them_back():
    gm, node, packed = _quant_linear_graph()
    a = args_of(node)
    assert (a.bits, a.group_size, a.bias) == (4, -1, None)
    assert torch.equal(a.tensor(gm, "qweight"), packed.qweight)
    assert [n.target for n in a.stored()] == ["layer_qweight", "layer_qzeros", "layer_scales", "layer_g_idx"]
    x = torch.randn(3, 32)
    expected = torch.ops.qc.quant_linear(x, *packed[:4], None, 4, -1)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
    weights = spec("quant_linear").weights(a, gm)
    assert weights == 8 * 32


def test_misuse_is_named():
    gm, node, _ = _quant_linear_graph()
    with pytest.raises(TypeError, match="no argument.*'qweigth'"):
        call_op(gm.graph, "quant_linear", qweigth=None)
    with pytest.raises(TypeError, match="missing.*'bits'"):
        call_op(gm.graph, "quant_linear", **{k: v for k, v in args_of(node).as_dict().items() if k != "bits"})
    with pytest.raises(AttributeError, match="no argument 'bitz'"):
        args_of(node).bitz
    with pytest.raises(KeyError, match="qc.nope is not a registered op"):
        spec("nope")
