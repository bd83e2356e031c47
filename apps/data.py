"""Inputs of the explorer: the built-in contrast sets and the parsing of what a user types or uploads.

* :func:`parse_prompt_text`: prompts from pasted or uploaded text (JSON list, JSON lines, or lines);
* :func:`check_pairs`: two prompt lists of equal, non-zero length;
* :func:`temporal_events` / :func:`render_events` / :func:`temporal_pairs`, :func:`refusal_pairs`:
  the built-in contrasts;
* :func:`parse_layers`: a layer selection such as ``"12"``, ``"10-14"`` or ``"3,5,9"``;
* :func:`parse_scales`, :func:`tune_layers`, :func:`tune_prompts`, :func:`tune_words`: the Tune page's
  grid, prompts and concept words, bounded by the ``MAX_TUNE_*`` limits;
* :func:`feature_texts`: the Features page's texts (pasted, or a built-in set), bounded by the
  ``MAX_FEATURE_*`` limits (the Circuits page reads a feature's contexts over the same sets); the Circuits
  page's bounds are the ``MAX_CIRCUIT_*`` and ``MAX_SUPERNODE*`` limits;
* ``IOI_*``: the Patching page's default prompt pair and answers.

The ``MAX_*`` constants below are every bound on what one request may carry or ask for (the
callbacks, :mod:`.io` and :mod:`.analysis` check them where each value is used, and their
messages name the limit).
"""
from __future__ import annotations

import json
import math
import random
from importlib import resources
from typing import Sequence

from steerkit.errors import InputError
from steerkit.hooks.names import parse_layers as core_parse_layers
from steerkit.storage import jsontext

# ---------------------------------------------------------------- limits of one request
#: prompt pairs of one divergence profile (pasted or uploaded lists)
MAX_PAIRS = 512
#: pairs of a built-in contrast (the "Pairs" field)
MAX_BUILTIN_PAIRS = 200
#: characters of one prompt in a list
MAX_PROMPT_CHARS = 4000
#: characters of a whole pasted prompt list (one text area)
MAX_PROMPT_LIST_CHARS = 1 << 20
#: prompts of one diagnostics run
MAX_DIAG_PROMPTS = 64
#: decoded bytes of one uploaded file (checked wherever an upload's contents are read)
UPLOAD_MAX_BYTES = 1 << 20
#: characters of the Steer page's prompt
MAX_STEER_PROMPT_CHARS = 4000
#: new tokens of one Steer generation
MAX_NEW_TOKENS = 128
#: largest absolute steering strength
MAX_STRENGTH = 1e4
#: seconds of model work one request may take (generation stops there with what it has)
MODEL_DEADLINE_S = 60.0
#: characters of a typed model path or hub id
MAX_MODEL_PATH_CHARS = 1000
#: characters of a layer selection, a store name, a picker value
MAX_FIELD_CHARS = 1000
#: bytes of one saved result file (a sweep table, an MI result)
MAX_RESULT_BYTES = 8 << 20
#: result files looked at by one scan of the results folder, and how deep it descends
MAX_RESULT_FILES = 2000
MAX_RESULT_DEPTH = 8
#: bytes read by one scan for MI results (each candidate is parsed to see whether it holds one)
MAX_SCAN_BYTES = 64 << 20
#: rows, distinct layers, distinct positions and methods of one sweep table
MAX_SWEEP_ROWS = 20_000
MAX_SWEEP_LAYERS = 512
MAX_SWEEP_POSITIONS = 512
MAX_SWEEP_METHODS = 64
#: steps of one MI trajectory, trajectories of one MI result
MAX_MI_STEPS = 100_000
MAX_MI_TRAJECTORIES = 1000
#: bytes of one HTTP request body (Flask refuses larger ones with 413)
MAX_REQUEST_BYTES = 16 << 20
#: characters of one Patching or Attention prompt, and tokens of it
MAX_PATCH_PROMPT_CHARS = 2000
MAX_PATCH_TOKENS = 64
#: characters of an answer token of the Patching page (" Mary")
MAX_ANSWER_CHARS = 100
#: cells of one patching grid (layers x positions, or layers x heads)
MAX_PATCH_SITES = 4096
#: tokens of the Attention page's prompt, and cells of one attention figure (heads x query x key)
MAX_ATTN_TOKENS = 128
MAX_ATTN_CELLS = 1 << 20
#: the hook grids the Patching page offers (``steerkit.probes.activation_patching``'s ``hook``)
PATCH_HOOKS = ("resid_pre", "attn_out", "mlp_out", "z")
#: what the Patching page computes
PATCH_METHODS = ("activation", "attribution", "both")
#: the Attention page's views: one head, or every head of the layer as small multiples
ATTN_VIEWS = ("one", "all")
#: the Tune page's grid: layers and scales of one tune, prompts and their characters, new tokens
#: per generation, characters of the concept and neutral fields
MAX_TUNE_LAYERS = 8
MAX_TUNE_SCALES = 8
MAX_TUNE_PROMPTS = 32
MAX_TUNE_PROMPT_CHARS = 1000
MAX_TUNE_NEW_TOKENS = 64
MAX_TUNE_CONCEPT_CHARS = 4000
#: seconds one tune may run (a background job with progress and cancel; the grid of every cell)
TUNE_DEADLINE_S = 900.0
#: a saved tune result: layers, scales, prompts, and characters of one generation
MAX_TUNE_RESULT_LAYERS = 128
MAX_TUNE_RESULT_SCALES = 128
MAX_TUNE_RESULT_CELLS = 4096
MAX_TUNE_RESULT_PROMPTS = 1024
MAX_TUNE_GENERATION_CHARS = 20_000
#: the Features page: characters of the text whose latents it finds, latents listed, texts of one
#: report (pasted, or taken from a built-in set) and characters of each, top contexts shown
MAX_FEATURE_TEXT_CHARS = 2000
MAX_FEATURE_K = 50
MAX_FEATURE_TEXTS = 256
MAX_FEATURE_DOC_CHARS = 2000
MAX_FEATURE_CONTEXTS = 50
#: the Circuits page: characters and tokens (the special token in front included) of the prompt, feature nodes
#: of one graph, logit targets, nodes drawn and edges drawn, pinned nodes, supernodes and the characters of a
#: supernode's name, the size of a clamp's scale (a multiple of the features' activations) and of a value
MAX_CIRCUIT_PROMPT_CHARS = 2000
MAX_CIRCUIT_TOKENS = 64
MAX_CIRCUIT_FEATURE_NODES = 2048
MAX_CIRCUIT_LOGITS = 10
MAX_CIRCUIT_DRAWN_NODES = 400
MAX_CIRCUIT_EDGES = 1500
MAX_CIRCUIT_PINNED = 64
MAX_SUPERNODES = 16
MAX_SUPERNODE_NAME_CHARS = 64
MAX_CIRCUIT_SCALE = 100.0
MAX_CIRCUIT_VALUE = 1000.0
#: the Features page's text sets: pasted texts, the shipped harmful and harmless instructions, the
#: temporal reversal stories (the built-in sets give ``MAX_FEATURE_TEXTS`` texts at most)
FEATURE_DATASETS = ("custom", "instructions", "temporal")
#: the Patching page's defaults: the IOI pair (names swapped) and its answers
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When John and Mary went to the store, Mary gave a drink to"
IOI_ANSWER, IOI_WRONG = " Mary", " John"


def check_text(value, what: str, max_chars: int = MAX_FIELD_CHARS, *, allow_none: bool = True) -> str:
    """``value`` as text of at most ``max_chars`` characters (``None`` -> ``""`` when allowed)."""
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise InputError(f"expected {what} as text, found {type(value).__name__}")
    if len(value) > max_chars:
        raise InputError(f"expected {what} of at most {max_chars} characters, found {len(value)}")
    return value


def check_int(value, what: str, lo: int, hi: int) -> int:
    """``value`` as a whole number in ``lo..hi`` (a number field's value, never a bool or a text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or int(value) != value or not lo <= value <= hi:
        raise InputError(f"expected {what} from {lo} to {hi}, found {str(value)[:40]!r}")
    return int(value)


def check_choice(value, what: str, choices: Sequence[str]) -> str:
    """``value`` as one of ``choices`` (a radio or dropdown value)."""
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"expected {what} in {list(choices)}, found {str(value)[:40]!r}")
    return value


def check_number(value, what: str, bound: float) -> float:
    """``value`` as a finite number with ``|value| <= bound``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or abs(value) > bound:
        raise InputError(f"expected {what} as a finite number from {-bound:g} to {bound:g}, "
                         f"found {str(value)[:40]!r}")
    return float(value)


# ============================================================================ prompt lists
def parse_prompt_text(text: str, what: str = "prompts") -> list[str]:
    """Prompts from pasted or uploaded text: a JSON list, JSON lines, or one prompt per line.

    Never evaluates anything: JSON is parsed with :func:`json.loads`, everything else is plain text.
    """
    if not isinstance(text, str):
        raise InputError(f"expected {what} as text, found {type(text).__name__}")
    if len(text) > MAX_PROMPT_LIST_CHARS:
        raise InputError(f"expected {what} of at most {MAX_PROMPT_LIST_CHARS} characters, found {len(text)}")
    s = text.strip()
    if not s:
        return []
    keys = ("prompt", "instruction", "text", "question")

    def pick(o, where):
        if isinstance(o, str):
            return o
        if isinstance(o, dict):
            for k in keys:
                if isinstance(o.get(k), str):
                    return o[k]
        raise InputError(f"expected a string or an object with one of {keys} in {what} at {where}, "
                         f"found {str(o)[:60]!r}")

    out: list[str]
    if s.startswith("["):
        try:
            data = jsontext.loads(s)
        except json.JSONDecodeError as e:
            raise InputError(f"expected a JSON list of prompts in {what}, found invalid JSON ({e.msg} at line "
                             f"{e.lineno})") from None
        if not isinstance(data, list):
            raise InputError(f"expected a JSON list in {what}, found {type(data).__name__}")
        out = [pick(o, f"item {i}") for i, o in enumerate(data)]
    elif s.startswith("{"):
        out = []
        for i, line in enumerate(s.splitlines()):
            if line.strip():
                try:
                    out.append(pick(jsontext.loads(line), f"line {i + 1}"))
                except json.JSONDecodeError as e:
                    raise InputError(f"expected one JSON object per line in {what}, found invalid JSON on line "
                                     f"{i + 1} ({e.msg})") from None
    else:
        out = [l.strip() for l in s.splitlines() if l.strip()]
    return bounded_prompts(out, what, MAX_PAIRS, MAX_PROMPT_CHARS)


def bounded_prompts(prompts: list[str], what: str, max_count: int, max_chars: int) -> list[str]:
    """``prompts`` checked to be at most ``max_count``, each at most ``max_chars`` characters.

    Examples:
        >>> from steerkit.apps.data import bounded_prompts
        >>> bounded_prompts(["a", "bb"], "the prompts", 2, 2)
        ['a', 'bb']
        >>> bounded_prompts(["a", "bbb"], "the prompts", 2, 2)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected prompts of at most 2 characters in the prompts, found 3 in prompt 2; shorten it
    """
    if len(prompts) > max_count:
        raise InputError(f"expected at most {max_count} prompts in {what}, found {len(prompts)}; keep fewer")
    for i, p in enumerate(prompts):
        if len(p) > max_chars:
            raise InputError(f"expected prompts of at most {max_chars} characters in {what}, found "
                             f"{len(p)} in prompt {i + 1}; shorten it")
    return prompts


def check_pairs(a: Sequence[str], b: Sequence[str]) -> tuple[list[str], list[str]]:
    """Two prompt lists of equal, non-zero length (at most ``MAX_PAIRS``)."""
    a, b = list(a or []), list(b or [])
    if not a or not b:
        raise InputError(f"expected two non-empty prompt lists, found {len(a)} prompts in A and {len(b)} in B")
    if len(a) != len(b):
        raise InputError(f"expected two lists of equal length (prompt i of A pairs with prompt i of B), "
                         f"found {len(a)} prompts in A and {len(b)} in B")
    if len(a) > MAX_PAIRS:
        raise InputError(f"expected at most {MAX_PAIRS} pairs, found {len(a)}")
    return a, b


_EVENTS = [
    "woke up", "made coffee", "read the news", "took a shower", "walked the dog", "answered emails",
    "went to the market", "cooked lunch", "called my sister", "fixed the bike", "watched a film",
    "wrote a letter", "cleaned the kitchen", "planted tomatoes", "paid the bills", "went for a run",
    "met a friend", "baked bread", "painted the fence", "fell asleep",
]
_FRAMES = [
    "Yesterday I {0}, then I {1}, and after that I {2}. What did I do last?",
    "First I {0}. Next I {1}. Finally I {2}. In what order did things happen?",
    "On Sunday I {0}, later I {1}, and in the evening I {2}. Summarise my day.",
]


def temporal_events(n: int, n_events: int = 3, seed: int = 0) -> list[list[str]]:
    """``n`` ordered event lists of ``n_events`` distinct events (deterministic for a seed)."""
    if n < 1 or n > MAX_PAIRS:
        raise InputError(f"expected 1..{MAX_PAIRS} pairs, found n={n}")
    if not 2 <= n_events <= len(_EVENTS):
        raise InputError(f"expected 2..{len(_EVENTS)} events per list, found {n_events}")
    rng = random.Random(seed)
    return [rng.sample(_EVENTS, n_events) for _ in range(n)]


def render_events(events: Sequence[str], frame: int = 0) -> str:
    ev = list(events)
    if len(ev) == 3:
        return _FRAMES[frame % len(_FRAMES)].format(*ev)
    return "I " + ", then I ".join(ev) + ". What did I do last?"


def temporal_pairs(n: int = 8, n_events: int = 3, seed: int = 0) -> tuple[list[str], list[str]]:
    """Temporal reversal pairs: ``a[i]`` tells events in order, ``b[i]`` the same events reversed."""
    evs = temporal_events(n, n_events, seed)
    a = [render_events(e, i) for i, e in enumerate(evs)]
    b = [render_events(list(reversed(e)), i) for i, e in enumerate(evs)]
    return a, b


def refusal_pairs(n: int = 8, split: str = "train") -> tuple[list[str], list[str]]:
    """Harmful (a) vs harmless (b) instructions from the data shipped with steerkit."""
    root = resources.files("steerkit") / "data" / "refusal"

    def read(kind):
        p = root / f"{kind}_{split}.json"
        if not p.is_file():
            raise InputError(f"expected the shipped prompt list at {p}, found nothing there")
        return [o["instruction"] for o in json.loads(p.read_text(encoding="utf-8"))]
    a, b = read("harmful"), read("harmless")
    n = min(n, len(a), len(b))
    return a[:n], b[:n]


# ============================================================================ layer selections
def parse_layers(spec, n_layers: int) -> list[int]:
    """``"12"``, ``"10-14"``, ``"3,5,9"``, ``"all"`` (or a list of ints) -> sorted layers below ``n_layers``: the
    core's layer lists (:func:`steerkit.hooks.names.parse_layers`) typed into a box of bounded length.

    Examples:
        >>> from steerkit.apps.data import parse_layers
        >>> parse_layers("10-12, 3", 30)
        [3, 10, 11, 12]
    """
    if isinstance(spec, str) and len(spec) > MAX_FIELD_CHARS:
        raise InputError(f"expected a layer selection of at most {MAX_FIELD_CHARS} characters, found {len(spec)}")
    return core_parse_layers(spec if spec is not None else "", n_layers)



# ============================================================================ the Tune page's grid
def parse_scales(spec) -> list[float]:
    """``"0.5, 1, 2, 4"`` (or a list of numbers) -> the distinct scales, sorted: finite, each at most
    ``MAX_STRENGTH`` in size, at most ``MAX_TUNE_SCALES`` of them.

    Examples:
        >>> from steerkit.apps.data import parse_scales
        >>> parse_scales("4, 1,2 , 1")
        [1.0, 2.0, 4.0]
        >>> parse_scales("1, 2, 3, 4, 5, 6, 7, 8, 9")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected at most 8 scales, found 9; choose fewer
    """
    if isinstance(spec, (list, tuple)):
        if len(spec) > MAX_TUNE_SCALES:
            raise InputError(f"expected at most {MAX_TUNE_SCALES} scales, found {len(spec)}; choose fewer")
        parts = list(spec)
    else:
        s = str(spec if spec is not None else "").strip()
        if len(s) > MAX_FIELD_CHARS:
            raise InputError(f"expected scales of at most {MAX_FIELD_CHARS} characters, found {len(s)}")
        if not s:
            raise InputError("expected scales like '1, 2, 4, 8', found nothing")
        parts = [p.strip() for p in s.split(",") if p.strip()]
        if len(parts) > MAX_TUNE_SCALES:
            raise InputError(f"expected at most {MAX_TUNE_SCALES} scales, found {len(parts)}; choose fewer")
    out = []
    for p in parts:
        try:
            x = float(p) if not isinstance(p, bool) else None
        except (TypeError, ValueError, OverflowError):
            x = None
        if x is None or not math.isfinite(x) or abs(x) > MAX_STRENGTH:
            raise InputError(f"expected scales as finite numbers from {-MAX_STRENGTH:g} to {MAX_STRENGTH:g} separated "
                             f"by commas (like '1, 2, 4, 8'), found {str(p)[:40]!r}")
        out.append(x)
    return sorted(set(out))


def tune_layers(spec, n_layers: int) -> list[int]:
    """A layer selection (:func:`parse_layers`) of at most ``MAX_TUNE_LAYERS`` layers for a tune.

    Examples:
        >>> from steerkit.apps.data import tune_layers
        >>> tune_layers("10-12, 20", 30)
        [10, 11, 12, 20]
        >>> tune_layers("all", 30)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected at most 8 layers for a tune, found 30; choose fewer (like '10-14')
    """
    layers = parse_layers(spec, n_layers)
    if len(layers) > MAX_TUNE_LAYERS:
        raise InputError(f"expected at most {MAX_TUNE_LAYERS} layers for a tune, found {len(layers)}; choose fewer "
                         "(like '10-14')")
    return layers


def tune_prompts(text, what: str = "prompts", *, allow_empty: bool = False) -> list[str]:
    """The prompts of a tune from pasted text (:func:`parse_prompt_text`): 1 to ``MAX_TUNE_PROMPTS``
    of them (none is allowed with ``allow_empty``), each at most ``MAX_TUNE_PROMPT_CHARS`` characters.

    Examples:
        >>> from steerkit.apps.data import tune_prompts
        >>> tune_prompts("Tell me a story.\\n\\nDescribe your day.")
        ['Tell me a story.', 'Describe your day.']
        >>> tune_prompts("", "neutral prompts", allow_empty=True)
        []
    """
    prompts = parse_prompt_text(check_text(text, f"the {what}", MAX_PROMPT_LIST_CHARS), f"the {what}")
    if not prompts and not allow_empty:
        raise InputError(f"expected at least one of the {what} (one per line), found none")
    return bounded_prompts(prompts, f"the {what} of a tune", MAX_TUNE_PROMPTS, MAX_TUNE_PROMPT_CHARS)


def tune_words(text, what: str = "words") -> list[str]:
    """Comma- or line-separated words (at most ``MAX_TUNE_CONCEPT_CHARS`` characters in all), stripped,
    empty ones dropped: the substrings a tune's concept looks for.

    Examples:
        >>> from steerkit.apps.data import tune_words
        >>> tune_words("wedding, love,\\nbride ,")
        ['wedding', 'love', 'bride']
    """
    text = check_text(text, f"the {what}", MAX_TUNE_CONCEPT_CHARS)
    return [w.strip() for w in text.replace("\n", ",").split(",") if w.strip()]


# ============================================================================ the Features page's texts
def feature_texts(kind, text=None) -> list[str]:
    """The texts a Features report reads: ``kind`` ``"custom"`` -- the pasted ``text`` (one per line, a JSON
    list or JSON lines, :func:`parse_prompt_text`), 1 to ``MAX_FEATURE_TEXTS`` texts of at most
    ``MAX_FEATURE_DOC_CHARS`` characters; ``"instructions"`` -- the shipped harmful and harmless instructions
    (:func:`refusal_pairs`, half of each); ``"temporal"`` -- the temporal reversal stories (:func:`temporal_pairs`).

    Examples:
        >>> from steerkit.apps.data import feature_texts
        >>> feature_texts("custom", "The cat sat.\\n\\nA dog ran.")
        ['The cat sat.', 'A dog ran.']
        >>> len(feature_texts("temporal")), len(feature_texts("instructions"))
        (256, 256)
        >>> feature_texts("custom", "")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected at least one text (one per line), found none; paste some or pick a built-in set
    """
    kind = check_choice(kind, "a text set", FEATURE_DATASETS)
    half = MAX_FEATURE_TEXTS // 2
    if kind == "instructions":
        a, b = refusal_pairs(half)
        return a + b
    if kind == "temporal":
        a, b = temporal_pairs(half)
        return a + b
    texts = parse_prompt_text(check_text(text, "the texts", MAX_PROMPT_LIST_CHARS), "the texts")
    if not texts:
        raise InputError("expected at least one text (one per line), found none; paste some or pick a built-in set")
    return bounded_prompts(texts, "the texts of a report", MAX_FEATURE_TEXTS, MAX_FEATURE_DOC_CHARS)
