"""The ``triton`` backend: every ``qc`` op in the graph becomes a Triton kernel launch.

The graph is copied (weights shared, not duplicated) and each quantized node's target is swapped
for the kernel with the same signature (``qcompiler.kernels``); the kernel picks its decode or
prefill variant from the number of rows at run time. SpQR's ``dense + sparse`` pair is fused: the
CSR kernel adds the outliers' product into the dense kernel's output in place. A node no kernel
handles keeps its reference op, and the plan — kernel or fallback with the reason, per node — goes
into the compiled model's report.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from qcompiler.algorithms.packing import SUPPORTED_BITS
from qcompiler.backends.triton_layout import LAYOUT_OPS, drop_unused_attributes, repack_node
from qcompiler.backends.triton_shared_quant import share_activation_quantizers
from qcompiler.errors import BackendError
from qcompiler.ir.op_registry import (
    args_of,
    implement,
    implementations,
    quantized_layer_path,
    refuse,
    register_target,
    spec,
    spec_of,
)
from qcompiler.ir.tensors import get_tensor, set_tensor
from qcompiler.pipeline.pass_base import PassRecord

__all__ = ["prepare_triton", "plan_triton"]

aten = torch.ops.aten

register_target("triton", "backend: Triton kernels (GPU; CPU under TRITON_INTERPRET=1)")


def _kernel(name: str) -> Callable[[], Callable]:
    """A loader of ``qcompiler.kernels.name``: importing Triton is slow, and TRITON_INTERPRET must be set before."""

    def load():
        from qcompiler import kernels

        return getattr(kernels, name)

    return load


implement("triton", "quant_linear", load=_kernel("gptq_linear"), kind="kernel", label="gptq_gemm")
implement(
    "triton", "quant_experts_linear", load=_kernel("gptq_experts_linear"), kind="kernel", label="gptq_gemm per expert"
)
implement("triton", "int8_linear", load=_kernel("int8_linear"), kind="kernel", label="int8_gemm")
implement("triton", "spqr_dense_linear", load=_kernel("spqr_dense_linear"), kind="kernel", label="spqr_gemm")
implement(
    "triton",
    "spqr_experts_linear",
    load=_kernel("spqr_experts_linear"),
    kind="kernel",
    label="spqr_gemm+csr_spmm per expert",
)
implement("triton", "sparse_outlier_linear", load=_kernel("csr_linear"), kind="kernel", label="csr_spmm")
implement("triton", "hadamard", load=_kernel("hadamard"), kind="kernel", label="hadamard")
implement("triton", "fp8_linear", load=_kernel("fp8_linear"), kind="kernel", label="fp8_gemm")
implement(
    "triton",
    "nvfp4_linear",
    load=_kernel("nvfp4_linear"),
    kind="kernel",
    label="fp4_gemv/dequant (W4A4: nvfp4_quant + fp32 matmul)",
)
implement("triton", "mxfp4_linear", load=_kernel("mxfp4_linear"), kind="kernel", label="fp4_gemv/dequant")
implement("triton", "fp8_kv_quant", load=_kernel("fp8_kv_quant"), kind="kernel", label="fp8_kv_quant")
refuse(
    "triton",
    "quant_embedding",
    "no Triton kernel for a quantized embedding lookup yet: such a node runs its plain-torch reference",
)
refuse(
    "triton",
    "gguf_linear",
    "no Triton kernel for llama.cpp's block bytes (K-quants, Q4_1, Q5_1) yet: such a node runs its "
    "plain-torch reference",
)


def _kernels():
    """The kernels module and ``{op overload: (label, kernel)}`` from the registrations above."""
    from qcompiler import kernels

    return kernels, {spec(op).overload: (impl.label, impl.load()) for op, impl in implementations("triton").items()}


def _static_problem(node: Node) -> Optional[str]:
    """Why no kernel applies to ``node``, judged from what the graph knows before running."""
    a = args_of(node)
    x = a.x.meta.get("val") if isinstance(a.x, Node) else None
    if x is not None and x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"{x.dtype} activations are not supported (supported: float16, bfloat16, float32)"
    bad = [getattr(a, w) for w in a.spec.code_widths if getattr(a, w) not in SUPPORTED_BITS]
    if bad:
        return f"{bad[0]}-bit codes are not supported (supported: {SUPPORTED_BITS})"
    return None


def _guarded(name: str, node_name: str, kernel: Callable, reference, record: PassRecord) -> Callable:
    """The kernel; if a call brings a combination it does not support, the reference op, once warned."""
    from qcompiler.kernels import UnsupportedKernel

    def launch(*args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except UnsupportedKernel as err:
            note = f"{node_name}: {err}; fell back to the reference {reference}"
            if note not in record.notes:
                record.notes.append(note)
                warnings.warn(note, stacklevel=2)
            return reference(*args, **kwargs)

    launch.__name__ = f"triton_{name}"
    return launch


def _fused_spqr(dense_kernel: Callable, csr_kernel: Callable) -> Callable:
    def spqr_linear(dense: dict, sparse: dict):
        """``dense(**dense) + sparse(**sparse)``: dense kernel, then CSR accumulating into its output."""
        return csr_kernel(**sparse, out=dense_kernel(**dense))

    return spqr_linear


def _spqr_reference(dense: dict, sparse: dict):
    return torch.ops.qc.spqr_dense_linear(**dense) + torch.ops.qc.sparse_outlier_linear(**sparse)


def _layer_name(node: Node) -> str:
    return quantized_layer_path(args_of(node))


def _spqr_pairs(graph) -> list[tuple[Node, Node, Node]]:
    """``add(spqr_dense_linear(x, …), sparse_outlier_linear(x, …))`` triples that can be fused."""
    pairs = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target != aten.add.Tensor or len(node.args) != 2:
            continue
        dense, sparse = node.args
        if not (isinstance(dense, Node) and isinstance(sparse, Node)):
            continue
        if (
            dense.target == torch.ops.qc.spqr_dense_linear.default
            and sparse.target == torch.ops.qc.sparse_outlier_linear.default
            and args_of(dense).x is args_of(sparse).x
            and len(dense.users) == 1
            and len(sparse.users) == 1
        ):
            pairs.append((node, dense, sparse))
    return pairs


def _retarget(node: Node, args: tuple, calls: tuple, name: str, layer: str, record: PassRecord) -> None:
    kernel, twin = calls
    node.target = _guarded(name, layer, kernel, twin, record)
    node.args, node.kwargs = args, {}


def _repacked(runner: GraphModule, node: Node, record: PassRecord, sparse: Optional[Node] = None) -> bool:
    """Retarget ``node`` (and fold in ``sparse``) to the layout kernels; False, with the reason in
    the plan, when the kernel layout cannot hold its weight (the stored-layout kernel runs it)."""
    from qcompiler.kernels import UnsupportedKernel

    layer, op = _layer_name(node), spec_of(node).name
    try:
        args, calls = repack_node(runner, node, sparse)
    except UnsupportedKernel as err:
        record.notes.append(f"{layer}: {err}; runs the stored-layout kernel")
        return False
    name = "layout_gemv/gemm" + (" per expert" if op.endswith("experts_linear") else "")
    if sparse is not None or op == "spqr_experts_linear":
        name += " + outliers"
    _retarget(node, args, calls, name, layer, record)
    record.layers[layer] = {"kernel": name}
    return True


def plan_triton(gm: GraphModule) -> tuple[GraphModule, PassRecord]:
    """A copy of ``gm`` whose ``qc`` nodes launch Triton kernels, and the per-node plan.

    GPTQ and SpQR weights are repacked into the kernels' layout on the copy (``triton_layout.py``);
    the other ops swap their target for the kernel with the same signature."""
    kernels, table = _kernels()
    record = PassRecord(name="backend:triton", config={"interpret": kernels.INTERPRET})
    graph = torch.fx.Graph()
    graph.set_codegen(copy.deepcopy(gm.graph._codegen))  # keeps the captured pytree in/out structure
    graph.output(graph.graph_copy(gm.graph, {}))
    runner = GraphModule(gm, graph, class_name="TritonGraphModule")
    runner.meta.update(gm.meta)
    graph = runner.graph
    done = set()
    for add, dense, sparse in _spqr_pairs(graph):
        if _static_problem(dense):
            continue
        if _repacked(runner, dense, record, sparse):
            add.replace_all_uses_with(dense)
            dense.meta.update(add.meta)
            graph.erase_node(add)
            graph.erase_node(sparse)
            done.add(dense)
            continue
        layer = _layer_name(dense)  # before erasing: an erased node's arguments are cleared
        with graph.inserting_before(add):
            fused_kernel = _fused_spqr(table[dense.target][1], table[sparse.target][1])
            call = graph.call_function(
                _guarded("spqr_gemm_csr", layer, fused_kernel, _spqr_reference, record),
                (args_of(dense).as_dict(), args_of(sparse).as_dict()),
            )
        call.meta.update(add.meta)
        add.replace_all_uses_with(call)
        for n in (add, sparse, dense):
            graph.erase_node(n)
        done.add(call)
        record.layers[layer] = {"kernel": "spqr_gemm+csr_spmm (fused add)"}
    shared = share_activation_quantizers(
        graph,
        lambda name, layer, kernel, twin: _guarded(name, layer, kernel, twin, record),
        _layer_name,
        lambda node: _static_problem(node) is None,
    )
    record.layers.update({layer: {"kernel": label} for layer, label in shared.items()})
    for node in list(graph.nodes):
        if node in done or node.op != "call_function" or node.target not in table:
            continue
        name, kernel = table[node.target]
        layer, problem = _layer_name(node), _static_problem(node)
        if problem:
            note = f"{layer}: {name}: {problem}; fell back to the reference {node.target}"
            record.notes.append(note)
            warnings.warn(note, stacklevel=2)
            record.layers[layer] = {"kernel": f"reference ({problem})"}
            continue
        if spec_of(node).name in LAYOUT_OPS and _repacked(runner, node, record):
            continue
        node.target = _guarded(name, layer, kernel, node.target, record)
        record.layers[layer] = {"kernel": name}
    drop_unused_attributes(runner)
    runner.recompile()
    return runner, record


def _weights_device(gm: GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = get_tensor(gm, node.target)
            if isinstance(value, torch.Tensor):
                return value.device
    return torch.device("cpu")


def _move_to(runner: GraphModule, device: torch.device) -> None:
    """Put the copy's tensors on ``device`` (the original graph keeps its own) and re-point the
    device constants torch.export baked into the graph (``arange(..., device=cpu)``, ``to(cpu)``)."""
    for node in runner.graph.nodes:
        if node.op == "get_attr":
            tensor = get_tensor(runner, node.target)
            if isinstance(tensor, torch.Tensor):
                set_tensor(
                    runner, node.target, tensor.detach().to(device), parameter=isinstance(tensor, torch.nn.Parameter)
                )
        retarget = lambda a: device if isinstance(a, torch.device) and a.type == "cpu" else a  # noqa: E731
        node.args = torch.fx.node.map_aggregate(node.args, retarget)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, retarget)
    runner.recompile()


class _OnDevice:
    """Calls a GPU graph with CPU inputs: inputs go to the GPU, outputs come back to the CPU."""

    def __init__(self, runner: GraphModule, device: torch.device):
        self.runner, self.device, self.record = runner, device, runner.record

    def __getattr__(self, name):  # graph, code, named_buffers ...: the GPU graph module's own
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs):
        to_gpu = lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        out = self.runner(*pytree.tree_map(to_gpu, args), **pytree.tree_map(to_gpu, kwargs))
        return pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, out)


def prepare_triton(gm: GraphModule, example_inputs=None):
    """The graph with its ``qc`` ops launched as Triton kernels; ``runner.record`` holds the plan.

    A graph whose weights are on the CPU runs on the GPU when there is one (weights copied there
    once; inputs and outputs moved per call), else under the interpreter when TRITON_INTERPRET=1.
    """
    kernels, _ = _kernels()
    device = _weights_device(gm)
    gpu = device.type == "cpu" and torch.cuda.is_available() and not kernels.INTERPRET
    problem = kernels.runtime_problem(torch.device("cuda") if gpu else device)
    if problem:
        raise BackendError(f"backend 'triton': {problem}")
    runner, record = plan_triton(gm)
    runner.record = record
    if gpu:
        _move_to(runner, torch.device("cuda"))
        return _OnDevice(runner, torch.device("cuda"))
    return runner
