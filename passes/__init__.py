"""Built-in passes, one per file. Each is a ``qc.Pass`` like any user-written pass."""

from qcompiler.passes import builtin_recipes  # noqa: F401  (registers the built-in recipe table and families)
from qcompiler.passes.auto_bits import AutoBits
from qcompiler.passes.awq import AWQ
from qcompiler.passes.embeddings import QuantizeEmbeddings
from qcompiler.passes.fp8_activations import FP8Activations
from qcompiler.passes.fp8_kv_cache import FP8KVCache
from qcompiler.passes.gptq import GPTQ
from qcompiler.passes.gptq_checkpoint import LoadGPTQCheckpoint
from qcompiler.passes.lower_int8 import LowerInt8
from qcompiler.passes.mixed_precision import MixedPrecision
from qcompiler.passes.nvfp4_activations import NVFP4Activations
from qcompiler.passes.rotate import Rotate
from qcompiler.passes.rtn import RTN
from qcompiler.passes.signround import SignRound
from qcompiler.passes.smoothquant import SmoothQuant
from qcompiler.passes.spqr import SpQR

__all__ = [
    "GPTQ",
    "RTN",
    "SmoothQuant",
    "LowerInt8",
    "SpQR",
    "LoadGPTQCheckpoint",
    "MixedPrecision",
    "AutoBits",
    "AWQ",
    "Rotate",
    "SignRound",
    "FP8Activations",
    "NVFP4Activations",
    "FP8KVCache",
    "QuantizeEmbeddings",
]
