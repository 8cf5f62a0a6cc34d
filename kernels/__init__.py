"""Triton kernels for the ``qc`` ops, each checked against the op's plain-torch reference.

One kernel per file. The GPTQ and SpQR weights are repacked once into the kernels' own layout
(``kernel_layout.py``; the GEMV and GEMM on it in ``layout_gemv.py`` / ``layout_gemm.py``); the other
kernels' host functions have the same signature as the ``qc`` op they implement (the stored-layout
GPTQ/SpQR kernels too, the fallback for weights the layout cannot hold), so ``backends/triton.py``
can swap one for the other node by node. On a CUDA GPU the
kernels are compiled and autotuned; on CPU they run under ``TRITON_INTERPRET=1`` (set before this
package is imported), which is slow but exact enough to prove them correct in CI.
"""

if __name__ == "kernels":
    # Imported as top-level ``kernels``: a checkout's root is first on sys.path (``python -m qcompiler``,
    # ``python -m pytest`` or torchrun from a clone), and this folder shadows ``kernels``, the Hugging
    # Face package transformers imports. Put the installed one in our place (the import system returns
    # what sys.modules holds once this file ran); where none is installed, an empty namespace package
    # (no file, no version): what transformers' availability check, which imports the package to read
    # its version, reads as "not installed". Stdlib only: qcompiler itself imports transformers.
    import importlib.machinery
    import importlib.util
    import os
    import sys
    import types

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        _installed = types.ModuleType("kernels", "not installed: the checkout's kernels/ is qcompiler.kernels")
        _installed.__spec__ = importlib.machinery.ModuleSpec("kernels", None, is_package=True)
        _installed.__path__ = []
        sys.modules["kernels"] = _installed
    else:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
else:
    from qcompiler.kernels.act_quant import quantize_rows
    from qcompiler.kernels.csr_spmm import csr_linear
    from qcompiler.kernels.fp4_linear import mxfp4_linear, nvfp4_linear
    from qcompiler.kernels.fp8_gemm import fp8_linear
    from qcompiler.kernels.fp8_kv import fp8_kv_quant
    from qcompiler.kernels.gptq_gemm import gptq_experts_linear, gptq_linear
    from qcompiler.kernels.hadamard import hadamard
    from qcompiler.kernels.int8_gemm import int8_linear
    from qcompiler.kernels.layout_linear import layout_experts_linear, layout_linear
    from qcompiler.kernels.norm_quant import rmsnorm_quantize_rows
    from qcompiler.kernels.spqr_gemm import spqr_dense_linear, spqr_experts_linear
    from qcompiler.kernels.tuning import INTERPRET, UnsupportedKernel, runtime_problem

__all__ = [
    "INTERPRET",
    "UnsupportedKernel",
    "runtime_problem",
    "quantize_rows",
    "rmsnorm_quantize_rows",
    "int8_linear",
    "fp8_linear",
    "nvfp4_linear",
    "mxfp4_linear",
    "fp8_kv_quant",
    "layout_linear",
    "layout_experts_linear",
    "gptq_linear",
    "gptq_experts_linear",
    "spqr_dense_linear",
    "spqr_experts_linear",
    "csr_linear",
    "hadamard",
]
