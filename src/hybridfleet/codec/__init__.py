"""Gradient codecs, their one wire framing, and worker-side error feedback.

    codec = get_codec("topk", ratio=0.01)
    feedback = ErrorFeedback(codec)
    payload = feedback.encode("fc1.weight", grad)      # worker
    update = get_codec("topk").decode_sparse(payload)  # server

numpy only: importing this package never imports a deep-learning framework.
"""

from hybridfleet.codec.base import Codec, SparseTensor
from hybridfleet.codec.feedback import ErrorFeedback
from hybridfleet.codec.frame import FrameHeader, read_header
from hybridfleet.codec.registry import (CODECS, LOSSLESS_CODECS, SPARSE_CODECS, WIRE_CODECS, codec_for, codec_options,
                                       get_codec)

__all__ = [
    "CODECS",
    "SPARSE_CODECS",
    "WIRE_CODECS",
    "Codec",
    "ErrorFeedback",
    "FrameHeader",
    "LOSSLESS_CODECS",
    "SparseTensor",
    "codec_for",
    "codec_options",
    "get_codec",
    "read_header",
]
