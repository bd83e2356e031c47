"""JSON that users type or send (pasted prompt lists, request specs, uploaded tables), parsed so that every
failure is a :class:`json.JSONDecodeError` with a line and a column.

:func:`json.loads` turns a whole number into an ``int`` with ``int()``, which refuses more than
``sys.get_int_max_str_digits()`` digits (4300 by default) with a ``ValueError`` of its own -- "Exceeds the
limit (4300 digits) for integer string conversion ... use sys.set_int_max_str_digits()" -- that is not a
``JSONDecodeError``, so a handler of malformed JSON let it through and a 5,000-digit number in a pasted list
surfaced as Python's message. :func:`loads` reports it as malformed JSON at that number's place instead.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from steerkit.errors import SteerkitError


class _LongNumber(SteerkitError):
    """Internal: carries the digits out of ``parse_int``; :func:`loads` turns it into a JSONDecodeError."""

    def __init__(self, digits: str):
        super().__init__(digits)
        self.digits = digits


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # only the digit limit: the scanner passes well-formed digits
        raise _LongNumber(text) from None


def loads(text: str | bytes) -> Any:
    """:func:`json.loads` of ``text``; a whole number too long for ``int()`` is a :class:`json.JSONDecodeError`
    (like any other malformed JSON) that names the limit and where the number starts.

    Examples:
        >>> from steerkit.storage.jsontext import loads
        >>> loads('["a", 2]')
        ['a', 2]
        >>> loads('[1, ' + '9' * 5000 + ']')
        Traceback (most recent call last):
        ...
        json.decoder.JSONDecodeError: a whole number of 5000 digits (at most 4300 are read; write it as a decimal such as 1e5000 if it is meant): line 1 column 5 (char 4)
    """
    try:
        return json.loads(text, parse_int=_parse_int)
    except _LongNumber as e:
        doc = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text
        n = len(e.digits.lstrip("-"))
        raise json.JSONDecodeError(f"a whole number of {n} digits (at most {sys.get_int_max_str_digits()} are read; "
                                   f"write it as a decimal such as 1e{n} if it is meant)", doc,
                                   max(0, doc.find(e.digits))) from None
