"""Weight quantization: rotated, row-normalised Lloyd-Max codes (`QuantizedLinear`, `QuantizedEmbedding`),
`quantize_model`, and the reservoir file that reloads a quantized model without redoing
any of the work (`save_reservoir`, `load_reservoir`, `graft_reservoir`). See docs/methods.md."""

from .affine import GroupAffineLinear
from .embedding import QuantizedEmbedding
from .linear import QuantizedLinear, SUPPORTED_BITS
from .model import fingerprint, quantize_model, quantized_layers
from .reservoir import (FORMAT_VERSION, ReservoirError, graft_reservoir, load_reservoir, save_reservoir)
from .rotation import StructuredRotation
from .shared import RotatingRMSNorm

__all__ = ["QuantizedLinear", "GroupAffineLinear", "QuantizedEmbedding", "SUPPORTED_BITS", "StructuredRotation", "RotatingRMSNorm", "quantize_model", "quantized_layers",
           "fingerprint", "save_reservoir", "load_reservoir", "graft_reservoir", "ReservoirError",
           "FORMAT_VERSION"]
