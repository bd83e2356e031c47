"""What the explorer's computations share: the cancel signal, progress ticks, calls one chunk at a time
(:func:`read_chunks`) and one-prompt tokenising (the
logit lens of a residual-space vector is :func:`steerkit.probes.lens.vector_lens`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

from steerkit.deprecation import moved
from steerkit.errors import InputError
from steerkit.model import Tokens

from ..data import MAX_ANSWER_CHARS, MAX_PATCH_PROMPT_CHARS, check_text

if TYPE_CHECKING:
    from steerkit.model import SteerModel


class Cancelled(Exception):
    """Raised inside a computation when its caller asked it to stop (a signal, not an error)."""


def tick(progress, should_stop, done, total):
    if should_stop is not None and should_stop():
        raise Cancelled("cancelled")
    if progress is not None:
        progress(done, total)


T = TypeVar("T")


def read_chunks(chunks: Sequence[Any], read: Callable[[Any], T], *, progress=None, should_stop=None,
                deadline: Optional[float] = None) -> tuple[list[T], bool]:
    """``read(chunk)`` for each of ``chunks`` in turn, as a report reads its texts: ``progress(done, total)`` before
    the first and after each, ``should_stop()`` cancels there (:class:`Cancelled`); past ``deadline`` seconds (from
    the start) it stops before the next chunk, the first always read. Returns the parts read and whether the
    deadline stopped it.

    Examples:
        >>> from steerkit.apps.analysis import read_chunks
        >>> read_chunks([[1, 2], [3]], sum), read_chunks([[1, 2], [3]], sum, deadline=-1.0)
        (([3, 3], False), ([3], True))
    """
    end = None if deadline is None else time.monotonic() + float(deadline)
    parts: list[T] = []
    tick(progress, should_stop, 0, len(chunks))
    for i, chunk in enumerate(chunks):
        if parts and end is not None and time.monotonic() > end:
            return parts, True
        parts.append(read(chunk))
        tick(progress, should_stop, i + 1, len(chunks))
    return parts, False


def __getattr__(name: str):
    if name == "logit_lens":  # the lens of one vector (steerkit.probes.logit_lens: the lens of a prompt's layers)
        return moved("steerkit.apps.analysis", name, "steerkit.probes.lens", "vector_lens")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def one_prompt(sm: SteerModel, text, what: str, max_tokens: int) -> tuple[Tokens, list[str]]:
    """One prompt (bounded text, bounded tokens) as one-row ``Tokens`` and its token labels."""
    text = check_text(text, what, MAX_PATCH_PROMPT_CHARS)
    if not text.strip():
        raise InputError(f"expected {what}, found nothing; type a prompt")
    toks = sm.tokenize([text], chat=False)
    n = int(toks.input_ids.shape[1])
    if n > max_tokens:
        raise InputError(f"expected {what} of at most {max_tokens} tokens, found {n}; shorten it")
    return toks, [sm.tokenizer.decode([int(i)]) for i in toks.input_ids[0].tolist()]


def answer_token(value, what: str) -> str:
    value = check_text(value, what, MAX_ANSWER_CHARS)
    if not value:
        raise InputError(f"expected {what} as one token (like ' Mary', with its leading space), found nothing")
    return value


