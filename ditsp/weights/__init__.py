"""Model-agnostic weight storage: checkpoint formats (one list), streaming load, weights kept
quantized (FP8, GGUF) and dequantized per layer."""

from .formats import FORMATS, Checkpoint, FormatError, error_line, from_tensors, open_any, open_checkpoint
from .fp8 import WEIGHTS_DTYPES
from .load import Materialized, assign, materialize, targets_of
from .quantized import QuantSpec, formats_held, held_bytes, is_quantized, max_buffer_bytes, quantized_weights
from .stored import StoredTensor

__all__ = ["FORMATS", "Checkpoint", "FormatError", "error_line", "from_tensors", "open_any", "open_checkpoint", "WEIGHTS_DTYPES",
           "Materialized", "assign", "materialize", "targets_of", "QuantSpec", "formats_held", "held_bytes",
           "is_quantized", "max_buffer_bytes", "quantized_weights", "StoredTensor"]
