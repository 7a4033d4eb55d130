"""Compiled forms of request-supplied texts (chat templates, grammars), by their text: the ``size`` most
recently used, safe to share between renderer threads.

A compile runs outside the lock, so a slow one holds up no other thread; two threads may compile the
same text at once and both results are equal. A compile that raises caches nothing. Texts longer than
``max_chars`` are compiled and used but never kept (one huge request cannot fill the cache's memory).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class CompiledCache(Generic[K, V]):
    def __init__(
        self, compile_fn: Callable[[K], V], size: int, max_chars: int, chars: Callable[[K], int]
    ) -> None:
        self._compile = compile_fn
        self._size = size
        self._max_chars = max_chars
        self._chars = chars
        self._lock = threading.Lock()
        self._compiled: OrderedDict[K, V] = OrderedDict()
        self.compiles = 0  # how many compilations it took (tests read it)

    def cached(self, source: K) -> V | None:
        """The compiled form if it is kept (and it becomes the most recent), else None."""
        with self._lock:
            value = self._compiled.get(source)
            if value is not None:
                self._compiled.move_to_end(source)
            return value

    def get(self, source: K) -> V:
        value = self.cached(source)
        if value is not None:
            return value
        value = self._compile(source)
        with self._lock:
            self.compiles += 1
            if self._chars(source) <= self._max_chars:
                self._compiled[source] = value
                self._compiled.move_to_end(source)
                while len(self._compiled) > self._size:
                    self._compiled.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._compiled)
