"""What every page shares: the context its callbacks run in (:class:`Context`: the model host and its
result cache, the one artifact store, the results folder, the time limits), the messages they show
(:func:`explain`, :func:`warn`, :func:`ok`), the checks of values a request carries (uploads, result
keys, table selections, store references) and the background-callback wiring of a page's progress bar
and cancel button (:func:`background`).

No request is trusted: every value a callback receives is checked where it is used (type, size, count;
the ``MAX_*`` limits of :mod:`steerkit.apps.data`).
"""
from __future__ import annotations

import base64
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

from dash import Input, Output, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError, SteerkitError
from steerkit.vectors import Store, check_compatible

from ..analysis import Cancelled
from ..data import MAX_FIELD_CHARS, UPLOAD_MAX_BYTES, check_text
from ..runtime import ModelHost, should_stop

#: characters of an uploaded file's name kept for messages and labels
MAX_NAME_CHARS = 200

HIDDEN = {"display": "none"}
SHOWN_PROGRESS = {"width": "220px", "visibility": "visible"}
HIDDEN_PROGRESS = {"width": "220px", "visibility": "hidden"}
#: the artifacts that steer (the Steer page's and the Tune page's pickers)
DIRECTION_KINDS = ("steering_vector", "direction_set")


@dataclass
class Context:
    """What the pages' callbacks share: ``env`` (the :class:`~steerkit.apps.app.AppEnv`: the model host,
    the store and results folders, the listed models, the time limits) and the one :class:`Store`."""

    env: Any
    store: Store

    @classmethod
    def of(cls, env) -> "Context":
        return cls(env=env, store=Store(env.store_path))

    @property
    def host(self) -> ModelHost:
        return self.env.host

    @property
    def results_path(self) -> str:
        return self.env.results_path

    def store_options(self, kinds, value=lambda ref: ref) -> list[dict]:
        """Dropdown options of the store's newest artifacts of ``kinds`` (value: ``value(ref)``)."""
        return [{"label": f"{row['ref']} ({row.get('kind')}, {row.get('method') or '?'})", "value": value(row["ref"])}
                for row in self.store.list(all_versions=False) if row.get("kind") in kinds]

    def stored(self, ref, kinds, what: str):
        """The stored artifact ``ref`` (one of ``kinds``), checked against the loaded model."""
        ref = check_text(ref, what, MAX_FIELD_CHARS).strip()
        if not ref:
            raise InputError(f"expected {what} from the store, found none; save one to the store first "
                             "(the Profiles page, or steerkit vectors import FILE --name NAME)")
        art = self.store.load(ref)
        if art.kind not in kinds:
            raise InputError(f"expected {what} ({' or '.join(kinds)}), found a {art.kind} ({ref})")
        check_compatible(art, self.host.get())
        return art


def background(prefix: str, interval: int = 400, *, progress=None, running=()) -> dict:
    """The keyword arguments of a page's background callback with a progress bar and a cancel button
    (``{prefix}-run``, ``{prefix}-cancel``, ``{prefix}-progress``); ``progress`` replaces the bar's
    outputs, ``running`` adds ``(output, while running, after)`` triples."""
    return dict(background=True, prevent_initial_call=True, interval=interval,
                progress=progress or [Output(f"{prefix}-progress", "value"), Output(f"{prefix}-progress", "max")],
                running=[(Output(f"{prefix}-run", "disabled"), True, False),
                         (Output(f"{prefix}-cancel", "disabled"), False, True),
                         (Output(f"{prefix}-progress", "style"), SHOWN_PROGRESS, HIDDEN_PROGRESS), *running],
                cancel=[Input(f"{prefix}-cancel", "n_clicks")])


def ticker(set_progress):
    """A ``progress(done, total)`` that forwards to a background callback's ``set_progress``."""
    return lambda done, total: set_progress((str(done), str(total)))


def warn(text):
    return html.Span(["⚠ ", text], style={"color": "#b00020"}, className="error-message")


def ok(text):
    return html.Span(text, style={"color": "#1b5e20"}, className="ok-message")


def note(children):
    """A grey hint (what to do when a page has nothing to show yet)."""
    return html.Span(children, style={"color": "#666"})


def explain(e: BaseException):
    """A message for the page: what went wrong, never a traceback (that goes to the server log).

    Every :class:`steerkit.errors.SteerkitError` (input, model, vectors, kernels, serving errors
    alike) is shown as its message; anything else is logged with its traceback and named."""
    if isinstance(e, Cancelled):
        return html.Span("Cancelled.", style={"color": "#666"}, className="cancel-message")
    if isinstance(e, SteerkitError):
        return warn(str(e))
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return warn(f"Unexpected error ({type(e).__name__}): {str(e)[:300]}")


def name_of(filename) -> str:
    return filename[:MAX_NAME_CHARS] if isinstance(filename, str) and filename else "upload"


def _too_big(n_bytes: int):
    return InputError(f"expected a file of at most {UPLOAD_MAX_BYTES >> 10} KiB, found {n_bytes >> 10} KiB")


def decode_upload(contents, filename):
    """The text of an upload component's ``contents`` (a ``data:...;base64,`` URL), at most
    ``UPLOAD_MAX_BYTES`` decoded: checked here, where the value is read, whoever sent it."""
    if not contents:
        raise PreventUpdate
    filename = name_of(filename)
    if not isinstance(contents, str):
        raise InputError(f"expected an uploaded file as a data URL, found {type(contents).__name__}")
    # base64 is 4 characters per 3 bytes: refuse an oversize value before decoding it
    if len(contents) > 4 * (UPLOAD_MAX_BYTES // 3 + 1) + 1024:
        raise _too_big(len(contents) * 3 // 4)
    try:
        _, b64 = contents.split(",", 1)
        data = base64.b64decode(b64, validate=False)
    except Exception:
        raise InputError(f"expected an uploaded file, could not decode {filename!r}") from None
    if len(data) > UPLOAD_MAX_BYTES:
        raise _too_big(len(data))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"expected a UTF-8 text file (.txt, .json, .jsonl, .csv), found binary data in "
                         f"{filename!r}") from None


def uploaded(data):
    """``(name, text)`` of an upload store (``{"name", "text"}``), each bounded, or ``None``."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        return None
    text = data["text"]
    if len(text) > UPLOAD_MAX_BYTES or len(text.encode("utf-8", "replace")) > UPLOAD_MAX_BYTES:
        raise _too_big(len(text.encode("utf-8", "replace")) if len(text) <= 4 * UPLOAD_MAX_BYTES else len(text))
    return name_of(data.get("name")), text


def key_of(data):
    """The result key a ``dcc.Store`` holds (``{"key": ...}``), or ``None`` for anything else."""
    if isinstance(data, dict) and isinstance(data.get("key"), str) and len(data["key"]) <= 64:
        return data["key"]
    return None


def selected_row(sel, rows):
    """The selected row of the store table (a dict with a text ``ref``), or ``None``."""
    if not isinstance(sel, list) or not sel or not isinstance(rows, list):
        return None
    i = sel[0]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(rows):
        return None
    r = rows[i]
    return r if isinstance(r, dict) and isinstance(r.get("ref"), str) and len(r["ref"]) <= MAX_FIELD_CHARS else None


def count(items, noun: str) -> str:
    """``"3 layers"``, ``"1 layer"``: how many ``items``, with the noun."""
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def layer_value(value):
    """A whole-number layer value, or ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layer_text(layers) -> str:
    """A layer box's text for ``layers``: ``"10-14"`` for a run, else ``"3,5,9"``."""
    ls = list(layers)
    if len(ls) > 1 and ls == list(range(ls[0], ls[-1] + 1)):
        return f"{ls[0]}-{ls[-1]}"
    return ",".join(map(str, ls))


def time_limit(seconds: float, what: str, hint: str = "ask for fewer pairs or prompts"):
    """A ``should_stop`` for one request: true when the job was cancelled; past ``seconds`` it
    raises an :class:`InputError` naming the limit and what to do (``hint``; the computation stops between
    batches)."""
    end = time.monotonic() + seconds

    def stop():
        if should_stop():
            return True
        if time.monotonic() > end:
            raise InputError(f"expected {what} to finish within the time limit of {seconds:g} s per request, found "
                             f"it still running; {hint}")
        return False
    return stop


def cached_reading(host: ModelHost, key: str, compute, deadline: float, hint: str = ""):
    """A reading of texts (a result with ``stopped_at_deadline``, ``n_read`` and ``n_texts``) from the cache or
    computed (``host.cached``); one cut short at the time limit is kept under a key of its own. Returns the result,
    whether it came from the cache, its key and the sentence that says it was cut short (empty when it was not)."""
    value, hit = host.cached(key, compute)
    cut = ""
    if value.stopped_at_deadline:  # a reading cut short is not what these settings give
        key = host.keep_partial(key, value)
        cut = (f" Stopped at the time limit of {deadline:g} s per request after {value.n_read} of {value.n_texts} "
               f"texts{hint}.")
    return value, hit, key, cut


def picker(options_of, current):
    """``(options, value)`` of a store picker: ``options_of()`` (nothing when the store cannot be read; the Store
    page says why), the current pick kept where it is still offered (not read and checked again), else the first."""
    try:
        opts = options_of()
    except Exception:  # noqa: BLE001 - an unreadable store lists nothing; the Store page says why
        opts = []
    values = [o["value"] for o in opts]
    if current in values:
        return opts, no_update
    return opts, values[0] if values else None
