"""One rule set for the names users type: artifact names and tags, version numbers, layer indices.

Used by the API, the CLI, the store, the app and the vLLM plugin alike, so a name that one accepts the
others accept too, and nothing else:

* an *index* (a version, a layer) is ASCII digits with no leading zero (``0``, ``7``, ``12``; not ``07``,
  not ``١``, not ``+3``, not ``3 ``);
* a *name* (an artifact, a tag) is 1-128 ASCII letters, digits, ``.``, ``_`` or ``-``, starting with a
  letter or a digit, without ``..``; the whole string must match (``\\Z``: a trailing newline is refused).
"""
from __future__ import annotations

import re
from typing import Any

INDEX = r"(?:0|[1-9][0-9]*)"
INDEX_RE = re.compile(INDEX + r"\Z", re.ASCII)
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z", re.ASCII)
MAX_INDEX = 1 << 31


def is_index(s: Any) -> bool:
    """Whether ``s`` is a string holding an index by the rule above."""
    # the length first: int() of thousands of digits raises Python's own conversion-limit error
    return (isinstance(s, str) and len(s) <= len(str(MAX_INDEX)) and INDEX_RE.match(s) is not None
            and int(s) < MAX_INDEX)


def parse_index(s: Any, what: str, error: type[Exception]) -> int:
    """``int(s)`` for an index by the rule above, else ``error`` saying what was expected and found."""
    if not is_index(s):
        raise error(f"expected {what} as ASCII digits without a leading zero (e.g. 0, 7, 12; below "
                    f"{MAX_INDEX}), found {s!r:.80}")
    return int(s)


def is_name(s: Any) -> bool:
    """Whether ``s`` is a name by the rule above."""
    return isinstance(s, str) and NAME_RE.match(s) is not None and ".." not in s
