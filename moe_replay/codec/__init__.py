"""Compact, checksummed serialisation of rollout traces (records) and of the route chunks records share."""

from .record import FORMAT, ChunkSource, decode_trace, encode_trace, peek_key, record_chunks
from .routes import ROUTE_CODECS, bound_bits_per_token_layer

__all__ = ["FORMAT", "ROUTE_CODECS", "ChunkSource", "bound_bits_per_token_layer", "decode_trace", "encode_trace", "peek_key",
           "record_chunks"]
