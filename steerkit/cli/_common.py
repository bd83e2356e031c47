"""Prompt files and hook lists as the command line reads them (shared by every verb group)."""
from __future__ import annotations

import json
from pathlib import Path

from steerkit.errors import InputError
from steerkit.hooknames import layer_names

PROMPT_KEYS = ("prompt", "instruction", "text", "question")


def read_records(path: str) -> list[dict]:
    """Records ``{"prompt": str, **fields}`` from a .json list, a .jsonl file or a text file (one per
    line); objects give their first field among :data:`PROMPT_KEYS` as the prompt."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"expected a prompts file at {p}, found nothing there")
    text = p.read_text(encoding="utf-8")

    def rec(obj, where):
        if isinstance(obj, str):
            return {"prompt": obj}
        if isinstance(obj, dict):
            for k in PROMPT_KEYS:
                if isinstance(obj.get(k), str):
                    return {**obj, "prompt": obj[k]}
        raise InputError(f"expected a string or an object with one of {PROMPT_KEYS} at {where}, found "
                         f"{str(obj)[:80]!r}")

    try:
        if p.suffix == ".jsonl":
            out = [rec(json.loads(l), f"{p}:{i + 1}") for i, l in enumerate(text.splitlines()) if l.strip()]
        elif p.suffix == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise InputError(f"expected a JSON list of prompts in {p}, found {type(data).__name__}")
            out = [rec(o, f"{p}[{i}]") for i, o in enumerate(data)]
        else:
            out = [{"prompt": l} for l in text.splitlines() if l.strip()]
    except json.JSONDecodeError as e:
        raise InputError(f"expected valid JSON in {p}, found a parse error: {e}") from None
    if not out:
        raise InputError(f"expected at least one prompt in {p}, found none")
    return out


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: ``.jsonl`` / ``.json`` list (strings or objects with a field of
    :data:`PROMPT_KEYS`), or one per line (see :func:`read_records`)."""
    return [r["prompt"] for r in read_records(path)]


def _hooks_arg(spec: str, n_layers: int) -> list[str]:
    """``resid_post:10-14`` / ``resid_post:all`` / comma-separated hook names."""
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if ":" in part:
            kind, rng = part.split(":", 1)
            kind = kind if kind.startswith("hook_") else f"hook_{kind}"
            if rng == "all":
                layers = range(n_layers)
            elif "-" in rng:
                a, b = rng.split("-")
                layers = range(int(a), int(b) + 1)
            else:
                layers = [int(x) for x in rng.split("+")]
            out += layer_names(layers, kind)
        elif part:
            out.append(part)
    return out
