"""A tiny name -> object registry shared by codecs, stores, model families and corrections.

A second registration under one name fails (no silent override); a miss lists what exists.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from .errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T) -> None:
        if name in self._items:
            raise RegistryError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
        self._items[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; supported: {', '.join(sorted(self._items)) or '(none)'}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)
