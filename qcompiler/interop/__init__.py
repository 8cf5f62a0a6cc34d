"""Formats other engines load: GPTQ (AutoGPTQ/GPTQModel/transformers/vLLM), compressed-tensors, and
onnxruntime-genai model folders."""
from .checkpoint import ExportError
from .compressed_tensors import export_compressed_tensors
from .gptq_checkpoint import export_gptq, import_gptq
from .onnx_genai import export_onnx_genai

__all__ = ["ExportError", "export_gptq", "import_gptq", "export_compressed_tensors", "export_onnx_genai"]
