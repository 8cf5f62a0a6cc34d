"""Checkpoint formats other engines load: GPTQ (AutoGPTQ/GPTQModel/transformers/vLLM) and compressed-tensors."""
from .checkpoint import ExportError
from .compressed_tensors import export_compressed_tensors
from .gptq_checkpoint import export_gptq, import_gptq

__all__ = ["ExportError", "export_gptq", "import_gptq", "export_compressed_tensors"]
