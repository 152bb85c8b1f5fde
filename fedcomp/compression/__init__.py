"""fedcomp.compression: codecs, the validated wire format and error feedback.

Pure PyTorch/numpy; nothing here imports Flower.

>>> import torch, fedcomp.compression as fc
>>> c = fc.get_compressor("stc", density=0.01)
>>> x = torch.randn(1000)
>>> x_hat = fc.decompress(c.compress(x))
>>> int((x_hat != 0).sum())
10
"""

from fedcomp.compression.base import Compressor, compression_error
from fedcomp.compression.decoding import codec_name, decompress, decompress_sparse
from fedcomp.compression.ef21 import EF21
from fedcomp.compression.error_feedback import ErrorFeedback, flatten_states, unflatten_states
from fedcomp.compression.errors import PayloadError
from fedcomp.compression.exact import EXACT_NAME, decode_exact, encode_exact, is_exact_dtype
from fedcomp.compression.options import Option
from fedcomp.compression.positions import information_bound_bits, rice_parameter
from fedcomp.compression.registry import (
    CODECS,
    available_compressors,
    codec_options,
    codecs_with,
    discover,
    get_compressor,
)
from fedcomp.compression.wire import DEFAULT_MAX_NUMEL, parse_header

discover()  # every codec module of this package registers its codec: a new codec is its file

__all__ = [
    "CODECS",
    "DEFAULT_MAX_NUMEL",
    "EXACT_NAME",
    "Compressor",
    "Option",
    "EF21",
    "ErrorFeedback",
    "PayloadError",
    "available_compressors",
    "codec_name",
    "codec_options",
    "codecs_with",
    "compression_error",
    "decode_exact",
    "decompress",
    "decompress_sparse",
    "encode_exact",
    "flatten_states",
    "get_compressor",
    "information_bound_bits",
    "is_exact_dtype",
    "parse_header",
    "rice_parameter",
    "unflatten_states",
]
