"""The refusal method's inputs: the vendored harmful / harmless instructions and their splits, the refusal-start
tokens and the chat template's post-instruction positions."""
from __future__ import annotations

import json
import random
from importlib import resources
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence, TypeVar

from steerkit.errors import InputError

if TYPE_CHECKING:
    from steerkit.model import SteerModel

T = TypeVar("T")

DEFAULT_REFUSAL_WORDS = ("I", "As")


def load_instructions(kind: str, split: str) -> list[str]:
    """The vendored instructions: ``kind`` in {"harmful", "harmless"}, ``split`` in {"train", "val"}.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> [len(R.load_instructions(k, s)) for k in ("harmful", "harmless") for s in ("train", "val")]
        [260, 39, 1000, 200]
        >>> R.load_instructions("harmful", "test")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected kind in ('harmful', 'harmless') and split in ('train', 'val'), ...
    """
    if kind not in ("harmful", "harmless") or split not in ("train", "val"):
        raise InputError(f"expected kind in ('harmful', 'harmless') and split in ('train', 'val'), "
                         f"found {kind!r}, {split!r}")
    f = resources.files("steerkit") / "data" / "refusal" / f"{kind}_{split}.json"
    data = json.loads(f.read_text(encoding="utf-8"))
    return [d["instruction"] for d in data]


def sample_splits(n_train: int, n_val: int, n_test: int, seed: int = 0) -> dict[str, dict[str, list[str]]]:
    """``{split: {"harmful": [...], "harmless": [...]}}`` for split in train/val/test.

    train and test are disjoint samples of the vendored *train* files (test is never used to
    compute or select anything); val comes from the *val* files and is used for selection only.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> s = R.sample_splits(4, 2, 3)
        >>> {k: [len(v) for v in s[k].values()] for k in s}, set(s["train"]["harmful"]) & set(s["test"]["harmful"])
        ({'train': [4, 4], 'val': [2, 2], 'test': [3, 3]}, set())
    """
    rng = random.Random(seed)
    out: dict[str, dict[str, list[str]]] = {"train": {}, "val": {}, "test": {}}
    for kind in ("harmful", "harmless"):
        tr = load_instructions(kind, "train")
        va = load_instructions(kind, "val")
        if n_train + n_test > len(tr) or n_val > len(va):
            raise InputError(f"expected at most {len(tr)} {kind} train+test and {len(va)} val prompts, "
                             f"found n_train={n_train}, n_test={n_test}, n_val={n_val}")
        tr = rng.sample(tr, n_train + n_test)
        out["train"][kind], out["test"][kind] = tr[:n_train], tr[n_train:]
        out["val"][kind] = rng.sample(va, n_val)
    return out


def probe_splits(n_train: int | None = None, n_test: int | None = None, seed: int = 0) -> tuple[dict, dict]:
    """``(train, test)``, each ``{"harmful": [...], "harmless": [...]}``, for the refusal probe.

    train: the vendored *train* files (every prompt when ``n_train`` is ``None``, else a seeded sample of
    ``n_train`` per side); test: the vendored *val* files (all, or ``n_test`` per side), with any prompt
    that is also in train dropped, so no held-out prompt reaches the fit.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> train, test = R.probe_splits()
        >>> len(train["harmful"]), len(train["harmless"]), len(test["harmful"]), len(test["harmless"])
        (260, 1000, 39, 200)
        >>> tr, te = R.probe_splits(4, 2)
        >>> [len(v) for v in (*tr.values(), *te.values())], set(tr["harmful"]) & set(te["harmful"])
        ([4, 4, 2, 2], set())
    """
    rng = random.Random(seed)
    train: dict[str, list[str]] = {}
    test: dict[str, list[str]] = {}
    for kind in ("harmful", "harmless"):
        tr = load_instructions(kind, "train")
        seen = set(tr) if n_train is None else None
        if n_train is not None:
            if not 1 <= n_train <= len(tr):
                raise InputError(f"expected 1 <= probe n_train <= {len(tr)} {kind} train prompts, found {n_train}")
            tr = rng.sample(tr, n_train)
            seen = set(tr)
        va = [p for p in load_instructions(kind, "val") if p not in seen]
        if n_test is not None:
            if not 1 <= n_test <= len(va):
                raise InputError(f"expected 1 <= probe n_test <= {len(va)} {kind} held-out prompts, found {n_test}")
            va = rng.sample(va, n_test)
        train[kind], test[kind] = tr, va
    return train, test


def refusal_token_ids(tokenizer, words: Iterable[str] = DEFAULT_REFUSAL_WORDS) -> list[int]:
    """First token id of each refusal-start word (as the first token of a response: no leading space).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> ids = R.refusal_token_ids(tiny.tokenizer)
        >>> ids, [tiny.tokenizer.decode([i]) for i in ids]
        ([57, 1653], ['I', 'As'])
    """
    ids: list[int] = []
    for w in words:
        t = tokenizer(w, add_special_tokens=False)["input_ids"]
        if not t:
            raise InputError(f"expected the refusal word {w!r} to have at least one token, found none")
        if t[0] not in ids:
            ids.append(int(t[0]))
    if not ids:
        raise InputError("expected at least one refusal word, found none")
    return ids


def post_instruction_positions(sm: "SteerModel", *, chat: bool = True) -> tuple[list[int], list[str]]:
    """The chat-template tokens after the instruction: negative indices (``-1`` = last) and their texts.

    Found at run time by formatting a sentinel instruction and taking every token that starts
    at or after the end of the instruction text. Without a chat template: ``[-1]``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> positions, texts = R.post_instruction_positions(tiny)
        >>> positions, texts[0], texts[-2]
        ([-6, -5, -4, -3, -2, -1], '<|im_end|>', 'istant')
    """
    sentinel = "Zq7 sentinel instruction"
    text = sm.format(sentinel, chat=chat)
    tok = sm.tokenizer
    end = text.rfind(sentinel)
    if end < 0 or text == sentinel:
        return [-1], [tok.decode(tok(text, add_special_tokens=False)["input_ids"][-1:])]
    end += len(sentinel)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    n = sum(1 for (a, b) in offs if a >= end)
    if n == 0:
        return [-1], [tok.decode(ids[-1:])]
    return list(range(-n, 0)), [tok.decode([i]) for i in ids[-n:]]


def batches(xs: Sequence[T], bs: int) -> Iterator[Sequence[T]]:
    """``xs`` in consecutive chunks of ``bs`` (the last one shorter).

    Examples:
        >>> from steerkit.probes.methods.refusal.data import batches
        >>> list(batches([1, 2, 3, 4, 5], 2))
        [[1, 2], [3, 4], [5]]
    """
    for i in range(0, len(xs), bs):
        yield xs[i:i + bs]
