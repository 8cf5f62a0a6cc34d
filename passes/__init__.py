"""Built-in passes, one per file. Each is a ``qc.Pass`` like any user-written pass."""
from .gptq import GPTQ
from .rtn import RTN

__all__ = ["GPTQ", "RTN"]
