"""Text to train a sparse autoencoder on: the corpus steerkit ships, a user's own, and fixed-length token chunks.

How it works
------------
:func:`read_corpus` gives the documents of a corpus: by default the one vendored in
``steerkit/data/corpus/`` (:data:`DEFAULT_CORPUS`: the State of the Union addresses 1790-2021 and Herman
Melville's *Moby-Dick*, public domain, ~2.42M tokens of SmolLM2's tokenizer; sources and licences in that
folder's README), or a file or folder the user names (``.txt`` / ``.md`` files, one document each, and ``.jsonl``
files of strings or objects with a ``"text"`` field, each optionally compressed as ``.xz``, ``.gz`` or ``.bz2``).

:func:`token_chunks` tokenizes documents in a seeded random order, joins them with the tokenizer's
end-of-sequence token as separator and cuts the stream into rows of ``ctx_len`` tokens that each *start* with
the separator. A trainer excludes the separator's positions: the first position of a row is where a
causal LM parks its attention (SmolLM2's residual stream there has a norm ~100x the others at layer 12), and
an SAE trained on it spends its variance budget on that one position. sparsify's own
``chunk_and_tokenize`` starts only the first row of each batch of documents with the separator, so these rows
are cut here. :func:`split_chunks` shuffles the rows and holds some out for evaluation.
"""
from __future__ import annotations

import bz2
import dataclasses
import gzip
import json
import lzma
import os
import random
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError

__all__ = ["DEFAULT_CORPUS", "CorpusChunks", "read_corpus", "token_chunks", "split_chunks", "separator_id"]

#: the corpus steerkit ships, under ``steerkit/data``
DEFAULT_CORPUS = "corpus/sotu_moby_dick.jsonl.xz"
_TEXT_SUFFIXES = (".txt", ".md", ".text")
_OPENERS: dict[str, Callable] = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}
_TOKENIZE_BATCH = 16  # documents a tokenizer call


def _suffixes(p: Path) -> tuple[str, Callable]:
    """``(format suffix, opener)`` of a corpus file: ``a.jsonl.xz`` -> ``(".jsonl", lzma.open)``."""
    opener: Callable = open
    name = p.name.lower()
    for ext, op in _OPENERS.items():
        if name.endswith(ext):
            name, opener = name[: -len(ext)], op
            break
    return Path(name).suffix, opener


def _documents_of_file(p: Path) -> list[str]:
    kind, opener = _suffixes(p)
    if kind not in (".jsonl", *_TEXT_SUFFIXES):
        raise InputError(f"expected a corpus file ending in .txt, .md or .jsonl (optionally .xz, .gz, .bz2), found "
                         f"{p.name!r}; convert it to one of those")
    try:
        with opener(p, "rt", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        raise InputError(f"expected UTF-8 text in the corpus file {p}, found bytes that are not UTF-8 (at offset "
                         f"{e.start}); save it as UTF-8") from None
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError, OSError) as e:
        raise InputError(f"expected a readable corpus file at {p}, found {type(e).__name__}: {e}; check the file "
                         "and its compression suffix") from None
    if kind in _TEXT_SUFFIXES:
        return [text]
    docs = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"expected one JSON value per line in {p}, found a parse error at line {i + 1}: {e}"
                             ) from None
        doc = row.get("text") if isinstance(row, dict) else row
        if not isinstance(doc, str):
            raise InputError(f"expected a string or an object with a string 'text' field at {p}:{i + 1}, found "
                             f"{str(row)[:80]!r}")
        docs.append(doc)
    return docs


def read_corpus(path: str | os.PathLike | None = None) -> list[str]:
    """The documents of a corpus: the vendored one (``path=None``), a corpus file, or every corpus file under a
    folder (sorted by path). Empty documents are dropped.

    Examples:
        >>> docs = read_corpus()
        >>> len(docs), docs[0][:43]
        (371, 'Fellow-Citizens of the Senate and House of ')
        >>> (tmp_dir / "mine.txt").write_text("Call me Ishmael.")
        16
        >>> read_corpus(tmp_dir / "mine.txt")
        ['Call me Ishmael.']
    """
    if path is None:
        with resources.as_file(resources.files("steerkit") / "data" / DEFAULT_CORPUS) as p:
            docs = _documents_of_file(p)
    else:
        p = Path(path)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and _suffixes(f)[0] in (".jsonl", *_TEXT_SUFFIXES))
            if not files:
                raise InputError(f"expected .txt, .md or .jsonl corpus files under the folder {p}, found none")
            docs = [d for f in files for d in _documents_of_file(f)]
        elif p.is_file():
            docs = _documents_of_file(p)
        else:
            raise InputError(f"expected a corpus file or folder at {p}, found nothing there; check the path")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise InputError(f"expected text in the corpus {path or DEFAULT_CORPUS}, found only empty documents")
    return docs


def separator_id(tokenizer) -> int:
    """The token that separates documents and starts every row: the tokenizer's end-of-sequence token (its
    beginning-of-sequence token where it has none).

    Examples:
        >>> separator_id(tiny.tokenizer), tiny.tokenizer.eos_token
        (2, '<|im_end|>')
    """
    for tok_id in (tokenizer.eos_token_id, tokenizer.bos_token_id):
        if isinstance(tok_id, int):
            return tok_id
    raise InputError("expected a tokenizer with an end-of-sequence (or beginning-of-sequence) token to separate "
                     "documents, found neither; set tokenizer.eos_token")


@dataclasses.dataclass(frozen=True)
class CorpusChunks:
    """Rows of token ids ``[rows, ctx_len]``, each starting with ``sep`` (the separator, also between documents).
    :attr:`counted` is the number of tokens per row that are not the separator (the ones a trainer learns from).

    Examples:
        >>> c = CorpusChunks(torch.tensor([[2, 5, 6, 2], [2, 7, 8, 9]]), sep=2)
        >>> c.counted.tolist(), c.tokens, len(c)
        ([2, 3], 5, 2)
    """

    ids: Int[Tensor, "rows ctx"]
    sep: int

    @property
    def counted(self) -> Int[Tensor, " rows"]:
        return (self.ids != self.sep).sum(-1)

    @property
    def tokens(self) -> int:
        return int(self.counted.sum())

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def select(self, rows: Sequence[int] | Tensor) -> "CorpusChunks":
        return CorpusChunks(self.ids[torch.as_tensor(rows, dtype=torch.long)], self.sep)


def _token_stream(tokenizer, documents: Sequence[str], sep: int, order: Iterable[int], bar) -> Iterable[list[int]]:
    """Each document's ids with a separator in front, in ``order``, a few documents a tokenizer call."""
    order = list(order)
    for start in range(0, len(order), _TOKENIZE_BATCH):
        batch = [documents[i] for i in order[start:start + _TOKENIZE_BATCH]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            bar.update(1)
            yield [sep, *ids]


def token_chunks(tokenizer, documents: Sequence[str], ctx_len: int, tokens: int, *, seed: int = 0,
                 progress: bool = True) -> CorpusChunks:
    """Rows of ``ctx_len`` tokens, each starting with the separator (:func:`separator_id`), holding at least
    ``tokens`` counted tokens (or all the corpus has, which may be fewer: the caller checks). Documents are
    tokenized in a random order (``seed``) and only as many as needed.

    Examples:
        >>> c = token_chunks(tiny.tokenizer, ["one two three four five six seven", "eight nine"], 4, tokens=5)
        >>> c.ids.shape[1], bool((c.ids[:, 0] == c.sep).all()), c.tokens >= 5
        (4, True, True)
    """
    if ctx_len < 2:
        raise InputError(f"expected a context length of at least 2 tokens (a separator and text), found {ctx_len}")
    sep = separator_id(tokenizer)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    body = ctx_len - 1
    rows: list[list[int]] = []
    counted = 0
    pending: list[int] = []
    with tqdm(total=len(documents), desc="tokenize corpus", unit="doc", disable=not progress, leave=False) as bar:
        for ids in _token_stream(tokenizer, documents, sep, order, bar):
            pending.extend(ids)
            while len(pending) >= body and counted < tokens:
                row = [sep, *pending[:body]]
                del pending[:body]
                rows.append(row)
                counted += sum(t != sep for t in row)
            if counted >= tokens:
                break
    ids_t = torch.tensor(rows, dtype=torch.long) if rows else torch.zeros((0, ctx_len), dtype=torch.long)
    return CorpusChunks(ids_t, sep)


def split_chunks(chunks: CorpusChunks, train_tokens: int, eval_tokens: int, *, seed: int = 0
                 ) -> tuple[CorpusChunks, CorpusChunks]:
    """``(train, held_out)``: the rows shuffled (``seed``); the first rows holding ``eval_tokens`` counted tokens
    are held out, the next rows holding ``train_tokens`` are for training (the last row may overshoot). An
    :class:`~steerkit.errors.InputError` when the rows hold too few.

    Examples:
        >>> c = CorpusChunks(torch.tensor([[2, 5, 6], [2, 7, 8], [2, 9, 9], [2, 4, 4]]), sep=2)
        >>> train, held = split_chunks(c, train_tokens=3, eval_tokens=2)
        >>> len(held), held.tokens, len(train), train.tokens
        (1, 2, 2, 4)
    """
    perm = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed))
    cum = chunks.counted[perm].cumsum(0)
    n_eval = int(torch.searchsorted(cum, eval_tokens)) + 1 if eval_tokens > 0 else 0
    base = int(cum[n_eval - 1]) if 0 < n_eval <= len(chunks) else 0
    n_train = int(torch.searchsorted(cum, base + train_tokens)) + 1
    if n_train > len(chunks) or n_eval > len(chunks):
        have = int(cum[-1]) if len(cum) else 0
        raise InputError(f"expected a corpus of at least {train_tokens + eval_tokens:,} tokens ({train_tokens:,} to "
                         f"train on and {eval_tokens:,} held out), found {have:,}; pass a larger corpus or fewer "
                         "tokens")
    return chunks.select(perm[n_eval:n_train]), chunks.select(perm[:n_eval])
