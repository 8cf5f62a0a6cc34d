"""Every storage layout's ops (and every other ``qc`` op) x every backend and exporter: an
implementation or a stated refusal, registered against the op spec beside the target's own code;
no target keeps a private per-op table. The targets come from the backend and export-format
registries (each names its op-registry target), so a new backend or format is asked about every op
without editing this file."""

import ast
import pathlib

import pytest
import torch
from tiny_models import example_inputs, make_model

import qcompiler as qc
from qcompiler.backends import available_backends, backend_target
from qcompiler.export_formats import export_format, export_format_names
from qcompiler.ir.op_registry import implementation, implementations, registered, storage_ops, targets
from qcompiler.layouts import layouts

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _registered_targets() -> set[str]:
    """Every backend's and export format's target (importing each writer registers its lines)."""
    found = {backend_target(name) for name in available_backends()}
    found |= {export_format(name).load_target() for name in export_format_names()}
    return found - {None}


def test_every_layout_op_is_implemented_or_refused_by_every_backend_and_export_format():
    needed = _registered_targets()
    assert {"eager", "triton", "onnx", "gptq", "compressed-tensors", "gguf"} <= needed  # the walk finds the built-ins
    assert needed <= set(targets()), f"registries name targets the op registry lacks: {needed - set(targets())}"
    assert set(layouts()) >= {"gptq", "gguf", "spqr", "int8"}
    missing = [
        f"{target} x {name} layout's qc.{op}"
        for name, lay in layouts().items()
        for op in lay.ops
        for target in needed
        if implementation(target, op) is None
    ]
    assert not missing, "no implementation or refusal registered for: " + ", ".join(missing)
    in_a_layout = {op for lay in layouts().values() for op in lay.ops}
    layout_free = {
        "hadamard",
        "fp8_kv_quant",
        "quant_embedding",
    }  # ops of no linear layout (ir/ops.py, gptq_embedding.py)
    assert {op.name for op in storage_ops()} <= in_a_layout | layout_free, "a stored op belongs to no layout"


def test_every_op_is_implemented_or_refused_by_every_target():
    _registered_targets()
    missing = [
        f"{target} x qc.{op.name}"
        for target in targets()
        for op in storage_ops()
        if implementation(target, op.name) is None
    ]
    assert not missing, "no implementation or refusal registered for: " + ", ".join(missing)
    for op in registered().values():  # an export-only op is implemented by the target that makes it
        if op.export_only is not None:
            impl = implementation(op.export_only, op.name)
            assert impl is not None and impl.refusal is None, op.name
    refusals = [implementation(t, op.name).refusal for t in targets() for op in storage_ops()]
    assert all(r is None or len(r) > 30 for r in refusals)  # a refusal says why, not just "no"


def test_implementations_load_to_callables():
    _registered_targets()
    for target in ("eager", "onnx", "gptq", "compressed-tensors", "gguf"):  # triton's load imports Triton
        for op in storage_ops():
            impl = implementation(target, op.name)
            if impl.refusal is None:
                assert callable(impl.load()), (target, op.name)
    # an ONNX translation loads to translate(accuracy_level) -> the onnxscript function
    for name, impl in implementations("onnx", kind="translation").items():
        assert callable(impl.load()(0)), name


def _per_op_tables(path: pathlib.Path, op_names: set[str], root: pathlib.Path = ROOT) -> list[str]:
    """Dict literals keyed by qc ops (``torch.ops.qc.X.default``, ``qc.X.default``) or op-name strings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        for key in node.keys:
            text = ast.unparse(key) if key is not None else ""
            if text.startswith(("torch.ops.qc.", "qc.")) or (isinstance(key, ast.Constant) and key.value in op_names):
                found.append(f"{path.relative_to(root)}:{node.lineno} keyed by {text}")
                break
    return found


def test_no_backend_or_exporter_keeps_its_own_per_op_table(tmp_path):
    names = set(registered())
    files = sorted((ROOT / "backends").glob("*.py")) + sorted((ROOT / "qcompiler" / "interop").glob("*.py"))
    assert len(files) > 10
    tables = [t for f in files for t in _per_op_tables(f, names)]
    assert not tables, tables
    # the check finds the kind of table the registry replaced
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nT = {torch.ops.qc.quant_linear.default: 1}\nU = {'int8_linear': 2}\n")
    assert len(_per_op_tables(probe, names, tmp_path)) == 2


def test_the_artifact_writer_refuses_export_only_ops(tmp_path):
    from qcompiler.backends.onnx_layout import lower_for_onnx

    cm = qc.compile(make_model("llama"), example_inputs("llama"), recipe="rtn-w4g128", progress=False)
    lowered, _ = lower_for_onnx(cm.graph_module)
    assert any(n.target is torch.ops.qc.matmul_nbits.default for n in lowered.graph.nodes)
    cm.graph_module = lowered
    with pytest.raises(qc.QCompilerError, match=r"is qc.matmul_nbits, which exists only inside the onnx export"):
        cm.save(tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_exporters_refuse_with_the_registered_reason(tmp_path):
    from qcompiler.interop import export_compressed_tensors, export_gptq

    cm = qc.compile(
        make_model("llama"),
        example_inputs("llama"),
        recipe="spqr-w3g16",
        calibration=[example_inputs("llama", 4, 16, seed=s) for s in range(2)],
        progress=False,
    )
    with pytest.raises(
        qc.QCompilerError,
        match=r"layer model.layers.0.self_attn.q_proj is qc.spqr_dense_linear: "
        r"the GPTQ format holds only weight-only",
    ):
        export_gptq(cm, tmp_path / "g")
    with pytest.raises(qc.QCompilerError, match="is qc.spqr_dense_linear: compressed-tensors cannot express it"):
        export_compressed_tensors(cm, tmp_path / "c")
