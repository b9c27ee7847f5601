"""Compact, checksummed serialisation of rollout traces."""

from .record import FORMAT, decode_trace, encode_trace, peek_key
from .routes import ROUTE_CODECS, bound_bits_per_token_layer

__all__ = ["FORMAT", "ROUTE_CODECS", "bound_bits_per_token_layer", "decode_trace", "encode_trace", "peek_key"]
