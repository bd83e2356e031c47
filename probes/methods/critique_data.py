"""The data of the hidden critique vector (:mod:`steerkit.probes.methods.critique`): templated arithmetic
traces and the vendored GSM8K error prefixes.

:func:`arithmetic_traces` and :func:`trace_pairs` write multi-step arithmetic ("Start with 12. Add 7.
Multiply by 3. ...") solved one step per line, clean or with one corrupted step whose written result is off
by a nonzero amount; later steps compute correctly from the written (wrong) value, so the final answer as
written is wrong, while :meth:`ArithTrace.recovered` is the same erroneous trace with the *right* final
answer. Deterministic for a seed. :func:`gsm8k_error_traces` reads the vendored GSM8K error prefixes (Phan et
al., MIT, see ``steerkit/data/README.md``).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace

from steerkit.storage.datafiles import read_jsonl
from steerkit.errors import InputError

_OPS = {"add": ("Add {b}.", "{a} + {b} = {r}", lambda a, b: a + b),
        "sub": ("Subtract {b}.", "{a} - {b} = {r}", lambda a, b: a - b),
        "mul": ("Multiply by {b}.", "{a} * {b} = {r}", lambda a, b: a * b)}
_STEP_RE = re.compile(r"^Step \d+: (-?\d+) ([+\-*]) (-?\d+) = (-?\d+)\.$")


@dataclass
class ArithTrace:
    """A multi-step arithmetic question and a step-by-step trace of it.

    ``steps[i]`` is ``"Step i+1: a op b = r."`` with ``r`` = ``values[i]`` as written. ``corrupted``
    is the index of the wrong step (``-1``: clean); ``answer`` is the final answer the trace states,
    ``true_answer`` the right one (``answer != true_answer`` for a corrupted trace as written, equal in
    its :meth:`recovered` version).

    Examples:
        >>> from steerkit.probes.methods.critique_data import make_trace
        >>> t = make_trace(3, corrupt=True, n_steps=3)
        >>> len(t.steps), 0 <= t.corrupted < 3, t.answer != t.true_answer, t.recovered().is_recovery
        (3, True, True, True)
        >>> t.text.splitlines()[-1] == t.answer_sentence
        True
    """

    question: str
    steps: list
    values: list
    corrupted: int
    answer: int
    true_answer: int
    ops: list = field(default_factory=list)  # (op, operand) per step

    @property
    def reasoning(self) -> str:
        return "\n".join(self.steps)

    @property
    def answer_sentence(self) -> str:
        return f"The answer is {self.answer}."

    @property
    def text(self) -> str:
        """The whole trace: the steps, then the answer sentence on its own line."""
        return self.reasoning + "\n" + self.answer_sentence

    @property
    def is_recovery(self) -> bool:
        return self.corrupted >= 0 and self.answer == self.true_answer

    def recovered(self) -> ArithTrace:
        """The same steps with the right final answer (unchanged for a clean trace)."""
        return replace(self, answer=self.true_answer)


def _chain(r: random.Random, n_steps: int):
    start = r.randint(2, 30)
    ops = []
    v = start
    for _ in range(n_steps):
        kind = r.choice(["add", "sub", "mul"] if abs(v) < 200 else ["add", "sub"])
        b = r.randint(2, 5) if kind == "mul" else r.randint(2, 40)
        ops.append((kind, b))
        v = _OPS[kind][2](v, b)
    return start, ops


def _write(start: int, ops, corrupt: int, delta: int):
    steps, values = [], []
    a = start
    for i, (kind, b) in enumerate(ops):
        r = _OPS[kind][2](a, b) + (delta if i == corrupt else 0)
        steps.append(f"Step {i + 1}: " + _OPS[kind][1].format(a=a, b=b, r=r) + ".")
        values.append(r)
        a = r
    return steps, values


def make_trace(question_seed: int, *, corrupt: bool, n_steps: int | None = None) -> ArithTrace:
    """One trace; the same ``question_seed`` gives the same question with or without ``corrupt``.

    Examples:
        >>> from steerkit.probes.methods.critique_data import check_step, make_trace
        >>> clean, bad = make_trace(7, corrupt=False), make_trace(7, corrupt=True)
        >>> clean.question == bad.question, clean.corrupted, all(check_step(s) for s in clean.steps)
        (True, -1, True)
        >>> check_step(bad.steps[bad.corrupted])
        False
    """
    r = random.Random(question_seed)
    k = n_steps if n_steps is not None else r.randint(3, 5)
    if k < 2:
        raise InputError(f"expected at least 2 steps per trace, found {k}")
    start, ops = _chain(r, k)
    j = r.randrange(k)
    delta = r.choice([-1, 1]) * r.randint(1, 9)
    question = f"Start with {start}. " + " ".join(_OPS[kind][0].format(b=b) for kind, b in ops) + \
        " What is the result?"
    clean_steps, clean_values = _write(start, ops, -1, 0)
    true = clean_values[-1]
    if not corrupt:
        return ArithTrace(question, clean_steps, clean_values, -1, true, true, list(ops))
    steps, values = _write(start, ops, j, delta)
    if values[-1] == true:  # the error cancelled out (a product with 0 cannot happen: b >= 2); shift it
        steps, values = _write(start, ops, j, delta + (1 if delta > 0 else -1))
    return ArithTrace(question, steps, values, j, values[-1], true, list(ops))


def arithmetic_traces(n: int = 40, seed: int = 0, *, error_rate: float = 0.5,
                      n_steps: int | None = None) -> list[ArithTrace]:
    """``n`` traces of distinct questions; each is corrupted with probability ``error_rate`` (seeded).

    Examples:
        >>> from steerkit.probes.methods.critique_data import arithmetic_traces
        >>> traces = arithmetic_traces(20, error_rate=0.5)
        >>> len(traces), len({t.question for t in traces}), 0 < sum(t.corrupted >= 0 for t in traces) < 20
        (20, 20, True)
    """
    if n < 0 or not 0.0 <= error_rate <= 1.0:
        raise InputError(f"expected n >= 0 and 0 <= error_rate <= 1, found n={n}, error_rate={error_rate}")
    r = random.Random(f"critique-{seed}")
    out = []
    for i in range(n):
        out.append(make_trace(seed * 1_000_003 + i, corrupt=r.random() < error_rate, n_steps=n_steps))
    return out


def trace_pairs(n: int = 40, seed: int = 0, *, n_steps: int | None = None) -> list[tuple[ArithTrace, ArithTrace]]:
    """``(clean, corrupted)`` traces of the same ``n`` questions.

    Examples:
        >>> from steerkit.probes.methods.critique_data import trace_pairs
        >>> pairs = trace_pairs(3)
        >>> [(c.question == e.question, c.corrupted, e.corrupted >= 0) for c, e in pairs][0]
        (True, -1, True)
    """
    if n < 0:
        raise InputError(f"expected n >= 0, found {n}")
    return [(make_trace(seed * 1_000_003 + i, corrupt=False, n_steps=n_steps),
             make_trace(seed * 1_000_003 + i, corrupt=True, n_steps=n_steps)) for i in range(n)]


def check_step(step: str) -> bool:
    """Whether a written step ``"Step k: a op b = r."`` is arithmetically right.

    Examples:
        >>> from steerkit.probes.methods.critique_data import check_step
        >>> check_step("Step 1: 12 * 3 = 36."), check_step("Step 2: 36 - 5 = 30.")
        (True, False)
    """
    m = _STEP_RE.match(step)
    if not m:
        raise InputError(f"expected a step like 'Step 1: 3 + 4 = 7.', found {step!r}")
    a, op, b, r = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
    return {"+": a + b, "-": a - b, "*": a * b}[op] == r


def gsm8k_error_traces(n: int | None = None, *, offset: int = 0, path=None) -> list[dict]:
    """Rows of the vendored GSM8K error prefixes (``question``, ``ground_truth``, ``search``: a reasoning
    prefix ending right after its first wrong calculation); Phan et al., MIT (``steerkit/data/README.md``).

    Examples:
        >>> from steerkit.probes.methods.critique_data import gsm8k_error_traces
        >>> rows = gsm8k_error_traces(2)
        >>> len(rows), sorted(k for k in rows[0] if k in ("question", "ground_truth", "search"))
        (2, ['ground_truth', 'question', 'search'])
    """
    rows = read_jsonl("critique/gsm8k_train_error_first300.jsonl", path=path, n=n, offset=offset,
                      what="question/ground_truth/search rows")
    for i, r in enumerate(rows):
        if not all(isinstance(r.get(k), str) for k in ("question", "ground_truth", "search")):
            raise InputError(f"expected question, ground_truth and search strings in row {offset + i}, "
                             f"found keys {sorted(r)}")
    return rows
