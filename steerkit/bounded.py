"""One small bounded mapping, for the few caches whose entries are put by key and evicted by count.

Where a cache is a function of hashable arguments, ``functools.lru_cache`` serves and is used instead;
:class:`BoundedDict` is for values made elsewhere and stored under a key (a server's compiled steerings by
spec, the app's finished jobs by id): the least recently used entry goes first once ``maxsize`` is reached.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Generic, TypeVar

from steerkit.errors import InputError

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(MutableMapping, Generic[K, V]):
    """A dict of at most ``maxsize`` entries; reading or writing a key makes it the most recent.

    Examples:
        >>> from steerkit.bounded import BoundedDict
        >>> d = BoundedDict(2)
        >>> d["a"], d["b"] = 1, 2
        >>> _ = d["a"]           # "a" is now the most recent
        >>> d["c"] = 3           # evicts "b"
        >>> sorted(d), d.get("b")
        (['a', 'c'], None)
    """

    def __init__(self, maxsize: int):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise InputError(f"expected a positive whole number of entries, found {maxsize!r}")
        self.maxsize = maxsize
        self._d: OrderedDict[K, V] = OrderedDict()

    def __getitem__(self, key: K) -> V:
        value = self._d[key]
        self._d.move_to_end(key)
        return value

    def __setitem__(self, key: K, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.maxsize:
            self._d.popitem(last=False)

    def __delitem__(self, key: K) -> None:
        del self._d[key]

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._d))

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"BoundedDict(maxsize={self.maxsize}, {len(self)} entries)"
