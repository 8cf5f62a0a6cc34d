"""Formats other engines load: GPTQ (AutoGPTQ/GPTQModel/transformers/vLLM), compressed-tensors, and
onnxruntime-genai model folders."""

from qcompiler.interop.checkpoint import ExportError
from qcompiler.interop.compressed_tensors import export_compressed_tensors
from qcompiler.interop.gptq_checkpoint import export_gptq
from qcompiler.interop.onnx_genai import export_onnx_genai

__all__ = ["ExportError", "export_gptq", "export_compressed_tensors", "export_onnx_genai"]
