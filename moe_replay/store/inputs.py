"""The arguments of the stores' methods, checked where they enter: keys and `layers`.

A key is a `str` that encodes as UTF-8 (the index holds its bytes); `layers` is an iterable of
int MoE layer ids (Python or NumPy integers). Anything else is a `StoreArgumentError` naming the
argument and what was found, before a file is read or written: never an `AttributeError` from
deep inside, and never a silent coercion (`int(1.7)` would read layer 1, and the str "12" would
read layers 1 and 2).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..errors import TraceFormatError, Where
from ..trace import RolloutTrace


class StoreArgumentError(TraceFormatError, TypeError):
    """An argument of a store method is not of the type it must have (a key that is not a UTF-8
    str, layers that are not ints, a trace that is not a RolloutTrace)."""


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def check_key(key: Any, store: str, argument: str = "key") -> str:
    """`key`, if it is a str that encodes as UTF-8; else StoreArgumentError naming `argument`."""
    where = Where(file=store, field=argument)
    if not isinstance(key, str):
        raise StoreArgumentError(where, "a str key", _found(key))
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as err:
        raise StoreArgumentError(where.with_(record=key.encode("utf-8", "backslashreplace").decode()), "a str encodable as UTF-8",
                                 f"{err.reason} at index {err.start} ({key[err.start:err.end]!r})") from None
    return key


def check_keys(keys: Any, store: str) -> list[str]:
    """A sequence of keys (not one str, which would iterate its characters), each checked."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise StoreArgumentError(Where(file=store, field="keys"), "a sequence of str keys", _found(keys))
    return [check_key(k, store, "keys") for k in keys]


def check_layers(layers: Any, store: str, record: str | None = None) -> tuple[int, ...] | None:
    """`layers` as a tuple of ints (None stays None: every layer); StoreArgumentError for a str,
    a non-iterable, or an element that is not an integer (bool, float, str, None refused)."""
    if layers is None:
        return None
    where = Where(file=store, record=record, field="layers")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise StoreArgumentError(where, "an iterable of int MoE layer ids", _found(layers))
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise StoreArgumentError(where, "int MoE layer ids", f"{_found(layer)} at position {i}")
        out.append(int(layer))
    return tuple(out)


def check_trace(trace: Any, store: str) -> RolloutTrace:
    """`trace`, if it is a RolloutTrace whose key is a UTF-8 str (put's argument)."""
    if not isinstance(trace, RolloutTrace):
        raise StoreArgumentError(Where(file=store, field="trace"), "a RolloutTrace", _found(trace))
    check_key(trace.key, store, "trace.key")
    return trace
