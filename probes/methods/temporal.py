"""Temporal divergence profile and Temporal Activation Injection (Shin et al., "Before It Fades").

Text version of the paper's video setup: an ordered list of events ``x`` and the same events in
reversed order ``x_rev`` (:func:`temporal_pairs` builds them from templates -- cause and effect,
daily routines, processes -- since no public text data fits).

* :func:`temporal_profile` -- ``tau_l = h_l(x)[last] - h_l(x_rev)[last]`` with ``h_l`` the output of
  block ``l`` (``blocks.{l}.hook_resid_post``) at the last prompt token;
  ``rel_l = mean_pairs ||tau_l|| / ||h_l(x)||`` (with its std, the spread), ``cos_l`` the mean cosine
  between ``h_l(x)`` and ``h_l(x_rev)``; the source layer is ``argmax rel``. A :class:`Profile`
  that plots, serialises, and gives the injection schedule.
* Injection: for every layer ``l`` after the source, ``h_l[last] += beta * w_l * tau_source`` with
  ``w_l = rel_l / max(rel)`` (or :func:`linear_decay` when no profile exists), at the last prompt
  token during prefill only (``positions="last"``: generated steps are never touched): one
  ``Intervention.add`` per layer (:func:`injection_spec`, for a fixed, dataset-mean tau);
  :func:`per_input_taus` + one such list per row give the per-input variant.
* :func:`order_questions` -- yes/no and two-choice order questions; :func:`choice_accuracy` scores
  them by comparing the next-token logits of the choices; :func:`choose_beta` picks beta on a dev
  split only.
* :func:`run` (``run(sm, TemporalConfig(...))``, ``steerkit temporal``) -- the profile on generated
  pairs, the source layer, and optionally the order-question evaluation, as a :class:`TemporalResult`.
"""
from __future__ import annotations

import math
import random
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from steerkit.deprecation import moved
from steerkit.errors import InputError
from steerkit.hooks.names import resid_post
from steerkit.interventions import Intervention
from steerkit.vectors import LayerSchedule, SteeringVector

from ..plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel

# --------------------------------------------------------------------------- data
_SCENARIOS: list[tuple[str, list[str]]] = [
    ("cause", ["the glass fell off the table", "the glass shattered on the floor", "Tom swept up the pieces"]),
    ("cause", ["it rained all night", "the river overflowed", "the road was closed"]),
    ("cause", ["the power went out", "the fridge stopped working", "the ice cream melted"]),
    ("cause", ["Anna planted a seed", "the seed sprouted", "a flower bloomed"]),
    ("cause", ["the alarm rang", "Sam woke up", "Sam got out of bed"]),
    ("cause", ["the ball hit the window", "the window cracked", "the owner came outside"]),
    ("cause", ["the oven got too hot", "the bread burned", "the smoke alarm went off"]),
    ("cause", ["the car ran out of fuel", "the car stopped on the road", "the driver called for help"]),
    ("cause", ["Mia dropped her phone in water", "the phone stopped working", "Mia bought a new phone"]),
    ("cause", ["the dog saw a cat", "the dog barked loudly", "the cat ran up a tree"]),
    ("routine", ["Ben woke up", "Ben brushed his teeth", "Ben ate breakfast", "Ben went to work"]),
    ("routine", ["Lisa came home", "Lisa cooked dinner", "Lisa washed the dishes", "Lisa went to sleep"]),
    ("routine", ["the class started", "the teacher gave a test", "the students handed it in"]),
    ("routine", ["Omar bought groceries", "Omar drove home", "Omar put the food in the fridge"]),
    ("routine", ["Kim put on her shoes", "Kim went for a run", "Kim took a shower"]),
    ("routine", ["Raj opened his laptop", "Raj wrote an email", "Raj sent the email"]),
    ("routine", ["the shop opened", "customers came in", "the shop closed"]),
    ("routine", ["Eva boarded the plane", "the plane took off", "the plane landed", "Eva left the airport"]),
    ("process", ["mix flour and water", "knead the dough", "bake the loaf"]),
    ("process", ["boil the water", "add the pasta", "drain the pasta", "add the sauce"]),
    ("process", ["write the letter", "put it in an envelope", "mail the envelope"]),
    ("process", ["dig a hole", "put the tree in the hole", "fill the hole with soil", "water the tree"]),
    ("process", ["wash the clothes", "dry the clothes", "fold the clothes"]),
    ("process", ["crack the eggs", "whisk the eggs", "cook the omelette"]),
    ("process", ["download the file", "open the file", "edit the file", "save the file"]),
    ("process", ["peel the apple", "cut the apple", "eat the apple"]),
    ("process", ["fill the kettle", "heat the water", "pour it over the tea", "drink the tea"]),
    ("process", ["sand the wood", "paint the wood", "let the paint dry"]),
]

_FRAMES = [
    "Here is what happened, in order: {events}.",
    "These events happened one after another: {events}.",
    "Read the sequence of events: {events}.",
]


@dataclass
class TemporalPair:
    """One event list in order (``events``) and reversed; ``text``/``text_rev`` are the prompts.

    Examples:
        >>> from steerkit.probes.methods.temporal import TemporalPair
        >>> p = TemporalPair(["boil the water", "add the pasta"], "process", "Events: {events}.",
        ...                  "What happened first?")
        >>> p.text
        'Events: boil the water; then add the pasta. What happened first?'
        >>> p.text_rev
        'Events: add the pasta; then boil the water. What happened first?'
    """

    events: list[str]
    kind: str
    frame: str
    question: str = ""

    def _render(self, evs: Sequence[str]) -> str:
        body = self.frame.format(events="; then ".join(evs))
        return f"{body} {self.question}".strip()

    @property
    def text(self) -> str:
        return self._render(self.events)

    @property
    def text_rev(self) -> str:
        return self._render(list(reversed(self.events)))


def temporal_pairs(n: int = 60, seed: int = 0, *, question: str = "What happened first?") -> list[TemporalPair]:
    """``n`` ordered event lists and their reversals from the templates (scenario, frame and a random
    contiguous sub-sequence of >= 2 events vary; deterministic in ``seed``).

    Examples:
        >>> from steerkit.probes.methods.temporal import temporal_pairs
        >>> pairs = temporal_pairs(5, seed=0)
        >>> same = [p.text for p in pairs] == [p.text for p in temporal_pairs(5)]  # deterministic in seed
        >>> len(pairs), all(len(p.events) >= 2 for p in pairs), same
        (5, True, True)
    """
    rng = random.Random(seed)
    out: list[TemporalPair] = []
    seen = set()
    tries = 0
    while len(out) < n:
        tries += 1
        kind, evs = rng.choice(_SCENARIOS)
        a = rng.randrange(0, len(evs) - 1)
        b = rng.randrange(a + 2, len(evs) + 1)
        sub, frame = evs[a:b], rng.choice(_FRAMES)
        key = (tuple(sub), frame)
        if key in seen and tries < 20 * n:
            continue
        seen.add(key)
        out.append(TemporalPair(list(sub), kind, frame, question))
    return out


@dataclass
class OrderItem:
    """A question about event order: ``prompt``, ``choices`` (next-token strings), ``answer`` index.

    Examples:
        >>> from steerkit.probes.methods.temporal import OrderItem
        >>> item = OrderItem("I woke up; then I ate. Question: Did 'I ate' happen before 'I woke up'?",
        ...                  ["Yes", "No"], answer=1, kind="yesno")
        >>> item.choices[item.answer]
        'No'
    """

    prompt: str
    choices: list[str]
    answer: int
    kind: str
    prompt_rev: str = ""  # the same question after the events in reversed order (per-input tau)


def order_questions(n: int = 200, seed: int = 1) -> list[OrderItem]:
    """Half yes/no ("Did A happen before B?"), half two-choice ("Which happened first? A) .. B) .."),
    balanced answers; the narrative is the ordered event list.

    Examples:
        >>> from steerkit.probes.methods.temporal import order_questions
        >>> items = order_questions(4)
        >>> [it.kind for it in items], [it.choices for it in items[:2]]
        (['yesno', 'choice', 'yesno', 'choice'], [['Yes', 'No'], ['A', 'B']])
    """
    rng = random.Random(seed)
    items: list[OrderItem] = []
    for i in range(n):
        kind, evs = rng.choice(_SCENARIOS)
        frame = rng.choice(_FRAMES)
        story = frame.format(events="; then ".join(evs))
        story_rev = frame.format(events="; then ".join(reversed(evs)))
        a, b = sorted(rng.sample(range(len(evs)), 2))
        if i % 2 == 0:
            truth = rng.random() < 0.5
            x, y = (evs[a], evs[b]) if truth else (evs[b], evs[a])
            q = f"\nQuestion: Did \"{x}\" happen before \"{y}\"? Answer Yes or No."
            items.append(OrderItem(story + q, ["Yes", "No"], 0 if truth else 1, "yesno", story_rev + q))
        else:
            first_is_a = rng.random() < 0.5
            o1, o2 = (evs[a], evs[b]) if first_is_a else (evs[b], evs[a])
            q = f"\nQuestion: Which happened first? A) {o1} B) {o2}\nAnswer with A or B."
            items.append(OrderItem(story + q, ["A", "B"], 0 if first_is_a else 1, "choice", story_rev + q))
    return items


# --------------------------------------------------------------------------- profile
@dataclass
class Profile:
    """The temporal divergence profile over layers (arrays of length ``n_layers``).

    Examples:
        >>> from steerkit.probes.methods.temporal import temporal_pairs, temporal_profile
        >>> prof = temporal_profile(tiny, temporal_pairs(4))
        >>> prof.n_layers, prof.n_pairs, tuple(prof.tau.shape), 0 <= prof.peak_layer < 4
        (4, 4, (4, 64), True)
        >>> sched = prof.schedule(source=1)  # weights rel_l / max(rel) after the source layer
        >>> list(sched.weights), type(prof.plot()).__name__
        ([2, 3], 'Figure')
    """

    rel: np.ndarray
    rel_std: np.ndarray
    cos: np.ndarray
    tau: torch.Tensor  # [n_layers, d_model], mean tau over pairs
    n_pairs: int
    taus: Optional[torch.Tensor] = field(default=None, repr=False)  # [n_pairs, n_layers, d_model]
    model_name: str = ""

    @property
    def n_layers(self) -> int:
        return int(len(self.rel))

    @property
    def peak_layer(self) -> int:
        return int(np.argmax(self.rel))

    source_layer = peak_layer

    @property
    def spread(self) -> np.ndarray:
        return self.rel_std

    def weights(self) -> np.ndarray:
        """``w_l = rel_l / max(rel)``."""
        return self.rel / float(np.max(self.rel))

    def schedule(self, source: Optional[int] = None):
        """A :class:`steerkit.vectors.LayerSchedule` with ``w_l`` for every layer after ``source``."""
        s = self.peak_layer if source is None else int(source)
        w = self.weights()
        return LayerSchedule({l: float(w[l]) for l in range(s + 1, self.n_layers)})

    def to_dict(self) -> dict:
        return {"model": self.model_name, "n_pairs": self.n_pairs, "peak_layer": self.peak_layer,
                "rel": [float(x) for x in self.rel], "rel_std": [float(x) for x in self.rel_std],
                "cos": [float(x) for x in self.cos]}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: rel_l with a +-1 std band, cos_l on a second axis, the source layer marked
        (:func:`steerkit.probes.plots.temporal.profile_figure`)."""
        with plotly_required():
            from ..plots import temporal as figures
        return figures.profile_figure(self, title=title)


def _texts(pairs) -> tuple[list[str], list[str]]:
    if not pairs:
        raise InputError("expected at least one (ordered, reversed) pair, found none")
    fw, rv = [], []
    for i, p in enumerate(pairs):
        if isinstance(p, TemporalPair):
            fw.append(p.text), rv.append(p.text_rev)
        elif isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(s, str) for s in p):
            fw.append(p[0]), rv.append(p[1])
        else:
            raise InputError(f"expected pairs as TemporalPair or (text, reversed_text), found "
                             f"{type(p).__name__} at index {i}")
    return fw, rv


def last_token_states(sm: "SteerModel", prompts: Sequence[str], layers: Optional[Sequence[int]] = None, *, batch_size: int = 16,
                      chat: bool = True) -> torch.Tensor:
    """``[n_prompts, n_layers, d_model]`` block outputs at the last prompt token (float32, CPU).

    Examples:
        >>> from steerkit.probes.methods.temporal import last_token_states
        >>> tuple(last_token_states(tiny, ["Hello there", "Good night"]).shape)
        (2, 4, 64)
        >>> tuple(last_token_states(tiny, ["Hello there"], layers=[1, 3]).shape)
        (1, 2, 64)
    """
    layers = list(range(sm.n_layers)) if layers is None else list(layers)
    names = resid_post(layers)
    out = []
    for i in range(0, len(prompts), batch_size):
        with sm.record(names, positions="last") as cache:
            sm.forward(list(prompts[i:i + batch_size]), chat=chat)
        out.append(torch.stack([cache[n] for n in names], 1).float().cpu())
    return torch.cat(out)


def temporal_profile(sm: "SteerModel", pairs, *, batch_size: int = 16, chat: bool = True, keep_taus: bool = True,
                     progress=None) -> Profile:
    """The profile of ``pairs`` (``TemporalPair`` or ``(text, reversed_text)``) on ``sm``.

    Examples:
        >>> from steerkit.probes.methods.temporal import temporal_profile
        >>> prof = temporal_profile(tiny, [("A; then B.", "B; then A."), ("C; then D.", "D; then C.")])
        >>> prof.n_pairs, prof.rel.shape, bool((prof.cos <= 1 + 1e-6).all())
        (2, (4,), True)
    """
    fw, rv = _texts(pairs)
    h = last_token_states(sm, fw, batch_size=batch_size, chat=chat)
    if progress:
        progress(len(fw))
    hr = last_token_states(sm, rv, batch_size=batch_size, chat=chat)
    if progress:
        progress(len(rv))
    return profile_from_states(h, hr, keep_taus=keep_taus, model_name=getattr(sm, "name", ""))


def profile_from_states(h: torch.Tensor, h_rev: torch.Tensor, *, keep_taus: bool = True,
                        model_name: str = "") -> Profile:
    """The profile from recorded states ``[n, n_layers, d]`` of the ordered and reversed prompts.

    ``rel_l = ||h - h_rev|| / ||h||``, averaged over the pairs.

    Examples:
        >>> from steerkit.probes.methods.temporal import profile_from_states
        >>> h = torch.ones(3, 2, 4)
        >>> h_rev = h.clone()
        >>> h_rev[:, 1] = 0.5  # the orders differ at layer 1 only
        >>> prof = profile_from_states(h, h_rev)
        >>> prof.rel.tolist(), prof.peak_layer, tuple(prof.taus.shape)
        ([0.0, 0.5], 1, (3, 2, 4))
    """
    h, h_rev = h.double(), h_rev.double()
    tau = h - h_rev
    rel = tau.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-12)  # [n, L]
    cos = torch.nn.functional.cosine_similarity(h, h_rev, dim=-1)
    n = h.shape[0]
    return Profile(rel=rel.mean(0).numpy(), rel_std=(rel.std(0) if n > 1 else torch.zeros_like(rel[0])).numpy(),
                   cos=cos.mean(0).numpy(), tau=tau.mean(0).float(), n_pairs=n,
                   taus=tau.float() if keep_taus else None, model_name=model_name)


# --------------------------------------------------------------------------- injection
def linear_decay(source: int, n_layers: int):
    """Fallback schedule without a profile: ``w_l`` falls linearly from 1 (layer after the source) to
    ``1 / (n_layers - 1 - source)`` at the last layer.

    Examples:
        >>> from steerkit.probes.methods.temporal import linear_decay
        >>> linear_decay(source=1, n_layers=6).weights
        {2: 1.0, 3: 0.75, 4: 0.5, 5: 0.25}
    """
    after = list(range(source + 1, n_layers))
    k = len(after)
    return LayerSchedule({l: (k - i) / k for i, l in enumerate(after)})


def injection_spec(tau_source: torch.Tensor, schedule, beta: float) -> list[Intervention]:
    """The injection as interventions: ``Intervention.add(blocks.l.hook_resid_post, tau_source, beta * w_l,
    positions="last")`` for every layer in the schedule (a :class:`~steerkit.vectors.LayerSchedule` or
    ``{layer: w_l}``) with a nonzero weight: the last prompt token, during prefill only. Apply with
    ``sm.steer(spec)``; ``sm.steer(rows=[spec, ...])`` steers each row with its own tau.

    Examples:
        >>> from steerkit.probes.methods.temporal import injection_spec, linear_decay
        >>> spec = injection_spec(torch.randn(64), linear_decay(1, 4), beta=2.0)
        >>> [(iv.site, iv.scale, iv.positions) for iv in spec]
        [('blocks.2.hook_resid_post', 2.0, 'last'), ('blocks.3.hook_resid_post', 1.0, 'last')]
        >>> with tiny.steer(spec):
        ...     logits = tiny("Hello")
    """
    weights = schedule.weights if hasattr(schedule, "weights") else dict(schedule)
    v = torch.as_tensor(tau_source, dtype=torch.float32).reshape(-1)
    kept = [(int(l), float(w)) for l, w in weights.items() if w != 0.0]
    return [Intervention.add(site, v, float(beta) * w, positions="last")
            for (_, w), site in zip(kept, resid_post([l for l, _ in kept]))]


def steer_injection(sm: "SteerModel", tau_source, schedule, beta: float):
    """Register Temporal Activation Injection on ``sm`` (a handle; use with ``with``): ``tau_source``
    ``[d_model]`` for every row, or ``[batch, d_model]`` for per-input taus (one spec per row). Its old name,
    ``inject``, still works and warns (:func:`steerkit.kernels.inject` is the kernel's injection of a vector).

    Examples:
        >>> from steerkit.probes.methods.temporal import linear_decay, steer_injection
        >>> plain = tiny(["A; then B.", "C; then D."])
        >>> with steer_injection(tiny, torch.randn(2, 64), linear_decay(1, 4), beta=4.0):  # one tau per row
        ...     injected = tiny(["A; then B.", "C; then D."])
        >>> bool((injected[:, -1] - plain[:, -1]).abs().max() > 0), bool(torch.equal(injected[:, 0], plain[:, 0]))
        (True, True)
    """
    t = torch.as_tensor(tau_source, dtype=torch.float32)
    if t.dim() == 1:
        return sm.steer(injection_spec(t, schedule, beta))
    return sm.steer(rows=[injection_spec(r, schedule, beta) for r in t])


def __getattr__(name: str):
    if name == "inject":  # renamed: steerkit.kernels.inject is the kernel's injection of a vector
        return moved(__name__, name, __name__, "steer_injection")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def per_input_taus(sm: "SteerModel", prompts: Sequence[str], reversed_prompts: Sequence[str], source: int, *,
                   batch_size: int = 16, chat: bool = True) -> torch.Tensor:
    """``[n, d_model]``: tau at the source layer for each input (needs the reversed pass).

    Examples:
        >>> from steerkit.probes.methods.temporal import per_input_taus
        >>> taus = per_input_taus(tiny, ["A; then B.", "C; then D."], ["B; then A.", "D; then C."], source=1)
        >>> tuple(taus.shape)
        (2, 64)
    """
    h = last_token_states(sm, prompts, [source], batch_size=batch_size, chat=chat)[:, 0]
    hr = last_token_states(sm, reversed_prompts, [source], batch_size=batch_size, chat=chat)[:, 0]
    return h - hr


def _choice_ids(sm: "SteerModel", choices: Sequence[str]) -> list[int]:
    ids = []
    for c in choices:
        t = sm.tokenizer(c, add_special_tokens=False)["input_ids"]
        if not t:
            raise InputError(f"expected a choice that tokenizes to at least one token, found {c!r}")
        ids.append(t[0])
    return ids


def choice_accuracy(sm: "SteerModel", items: Sequence[OrderItem], *, steering=None, steer_rows=None,
                    batch_size: int = 16, chat: bool = True) -> dict:
    """Accuracy (argmax over the choices' first tokens at the next position) with a Wilson 95% interval.

    ``steering``: ``None`` or a fixed steering (interventions, e.g. :func:`injection_spec`'s, applied at the
    last prompt token) for every row; ``steer_rows``: instead, a callable ``(batch_items) -> one steering
    per row`` (per-input taus).

    Examples:
        >>> from steerkit.probes.methods.temporal import choice_accuracy, order_questions
        >>> out = choice_accuracy(tiny, order_questions(6))
        >>> out["n"], 0 <= out["accuracy"] <= 1, len(out["ci95"])
        (6, True, 2)
    """
    correct = []
    for i in range(0, len(items), batch_size):
        batch = list(items[i:i + batch_size])
        if steer_rows is not None:
            ctx = sm.steer(rows=steer_rows(batch), positions="last")
        else:  # an empty steering: the source is the last layer
            ctx = sm.steer(steering, positions="last") if steering else nullcontext()
        with ctx:
            logits = sm.forward([it.prompt for it in batch], chat=chat)[:, -1].float()
        for r, it in enumerate(batch):
            ids = _choice_ids(sm, it.choices)
            correct.append(int(int(torch.argmax(logits[r, ids])) == it.answer))
    n, k = len(correct), sum(correct)
    return {"n": n, "accuracy": k / n if n else float("nan"), "ci95": list(wilson(k, n))}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of ``k`` successes in ``n`` trials; NaNs when ``n`` is 0.

    Examples:
        >>> from steerkit.probes.methods.temporal import wilson
        >>> tuple(round(x, 3) for x in wilson(8, 10))
        (0.49, 0.943)
    """
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def choose_beta(sm: "SteerModel", dev_items: Sequence[OrderItem], tau_source, schedule, betas: Sequence[float], **kw) -> tuple[float, list]:
    """The beta with the best dev accuracy (ties: the smallest |beta|); never pass the reported split.

    Examples:
        >>> from steerkit.probes.methods.temporal import choose_beta, linear_decay, order_questions
        >>> beta, rows = choose_beta(tiny, order_questions(4), torch.randn(64), linear_decay(1, 4), [0.0, 1.0])
        >>> beta in (0.0, 1.0), [b for b, _ in rows]
        (True, [0.0, 1.0])
    """
    rows = []
    for b in betas:
        spec = None if b == 0 else injection_spec(tau_source, schedule, b)
        rows.append((float(b), choice_accuracy(sm, dev_items, steering=spec, **kw)["accuracy"]))
    best = max(rows, key=lambda r: (r[1], -abs(r[0])))
    return best[0], rows


# --------------------------------------------------------------------------- the whole method
@dataclass
class TemporalConfig:
    """``steerkit temporal``: ``n_pairs`` generated event pairs; ``eval`` order questions to evaluate
    (0: skip) with beta picked among ``betas`` on ``n_dev`` separate dev questions; ``source``: the
    source layer (default: the profile's peak, or the peak among the earlier layers when that is the
    last layer, since nothing follows it).

    Examples:
        >>> from steerkit.probes.methods.temporal import TemporalConfig
        >>> TemporalConfig().n_pairs, TemporalConfig().betas, TemporalConfig(n_pairs=8, source=1).source
        (60, (0.0, 0.5, 1.0, 2.0, 4.0), 1)
    """

    n_pairs: int = 60
    eval: int = 0
    n_dev: int = 40
    betas: tuple = (0.0, 0.5, 1.0, 2.0, 4.0)
    seed: int = 0
    source: Optional[int] = None


@dataclass
class TemporalResult:
    """The profile, the source layer and its injection schedule, and the evaluation (when asked).

    Examples:
        >>> from steerkit.probes.methods import temporal
        >>> res = temporal.run(tiny, temporal.TemporalConfig(n_pairs=4, source=1), progress=False)
        >>> res.source, list(res.schedule.weights), sorted(res.to_json())
        (1, [2, 3], ['profile', 'source_layer'])
        >>> arts = res.artifacts(tiny)
        >>> arts["temporal-tau"].layers, store.save("temporal-tau", arts["temporal-tau"])
        ([2, 3], 'temporal-tau@1')
    """

    profile: Profile
    source: int
    schedule: LayerSchedule
    note: Optional[str] = None
    eval: Optional[dict] = None  # dev_rows, beta, base, fixed_tau, per_input_tau

    def to_json(self) -> dict:
        out = {"profile": self.profile.to_dict(), "source_layer": self.source}
        if self.note:
            out["note"] = self.note
        if self.eval is not None:
            out["eval"] = {k: ([list(r) for r in v] if k == "dev_rows" else v) for k, v in self.eval.items()}
        return out

    def plot(self, title: str | None = None):
        """The profile's figure (:meth:`Profile.plot`)."""
        return self.profile.plot(title)

    def artifacts(self, sm: "SteerModel") -> dict:
        """``{"temporal-tau": SteeringVector, "temporal-schedule": LayerSchedule}``: the dataset-mean tau of
        the source layer, injected at every later layer with the schedule, at the last prompt token
        (``positions=[-1]``, as :func:`injection_spec`), scaled by the evaluation's beta when there is one: so
        ``sm.steer(artifact)`` is the method's fixed-tau injection."""
        prof, src = self.profile, self.source
        beta = float(self.eval["beta"]) if self.eval and "beta" in self.eval else 1.0
        sv = SteeringVector.from_direction(prof.tau[src], list(self.schedule.weights), sm, scale=beta,
                                           positions=[-1], method="temporal-injection",
                                           metrics={"source_layer": src, "rel": [float(x) for x in prof.rel]})
        sv.schedule = self.schedule
        return {"temporal-tau": sv, "temporal-schedule": self.schedule}


def run(sm: "SteerModel", config: TemporalConfig | None = None, *, progress: bool = True) -> TemporalResult:
    """The temporal divergence profile on ``config.n_pairs`` generated pairs, the source layer, and (with
    ``config.eval``) order-question accuracy without injection, with the fixed tau and with per-input taus.

    Examples:
        >>> from steerkit.probes.methods import temporal
        >>> cfg = temporal.TemporalConfig(n_pairs=4, eval=4, n_dev=4, betas=(0.0, 1.0))
        >>> res = temporal.run(tiny, cfg, progress=False)
        >>> sorted(res.eval), res.eval["base"]["n"]
        (['base', 'beta', 'dev_rows', 'fixed_tau', 'per_input_tau'], 4)
    """
    cfg = config or TemporalConfig()
    if cfg.n_pairs < 2:
        raise InputError(f"expected n_pairs >= 2, found {cfg.n_pairs}")
    if cfg.source is not None and not 0 <= cfg.source < sm.n_layers - 1:
        raise InputError(f"expected source in 0..{sm.n_layers - 2} (a later layer must exist), found {cfg.source}")
    pairs = temporal_pairs(cfg.n_pairs, seed=cfg.seed)
    with tqdm(total=2 * len(pairs), desc="temporal profile", file=sys.stderr, disable=not progress) as bar:
        prof = temporal_profile(sm, pairs, progress=bar.update)
    src, note = prof.peak_layer, None
    if cfg.source is not None:
        src = int(cfg.source)
    elif src == sm.n_layers - 1:
        src = int(prof.rel[:-1].argmax())
        note = f"peak is the last layer; source {src} = argmax over layers < {sm.n_layers - 1}"
    sched = prof.schedule(src)
    ev = None
    if cfg.eval:
        items = order_questions(cfg.n_dev + cfg.eval, seed=cfg.seed + 1)
        dev, test = items[: cfg.n_dev], items[cfg.n_dev:]
        tau = prof.tau[src]
        with tqdm(total=4, desc="order questions", file=sys.stderr, disable=not progress) as bar:
            beta, rows = choose_beta(sm, dev, tau, sched, [float(b) for b in cfg.betas])
            bar.update(1)
            base = choice_accuracy(sm, test)
            bar.update(1)
            fixed = choice_accuracy(sm, test, steering=injection_spec(tau, sched, beta))
            bar.update(1)

            def per_input(batch):
                taus = per_input_taus(sm, [it.prompt for it in batch], [it.prompt_rev for it in batch], src)
                return [injection_spec(t, sched, beta) for t in taus]
            per = choice_accuracy(sm, test, steer_rows=per_input)
            bar.update(1)
        ev = {"dev_rows": rows, "beta": beta, "base": base, "fixed_tau": fixed, "per_input_tau": per}
    return TemporalResult(prof, src, sched, note, ev)
