"""Built-in passes, one per file. Each is a ``qc.Pass`` like any user-written pass."""
from .gptq import GPTQ
from .gptq_checkpoint import LoadGPTQCheckpoint
from .lower_int8 import LowerInt8
from .rtn import RTN
from .smoothquant import SmoothQuant
from .spqr import SpQR

__all__ = ["GPTQ", "RTN", "SmoothQuant", "LowerInt8", "SpQR", "LoadGPTQCheckpoint"]
