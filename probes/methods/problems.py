"""Word problems with a numeric answer, the prompts that ask a model to solve them, and reading the
answer back: the data of the concise-reasoning region (:mod:`.region`) and of the thinking-token study
(:mod:`.mi`).

* :func:`arithmetic_problems`: templated multi-step arithmetic (``"easy"``: one-digit numbers;
  ``"medium"``: two-digit numbers, change, rates, sharing); :func:`gsm8k_problems`: the vendored first
  300 GSM8K test problems.
* :data:`VERBOSE_PROMPT`, :data:`CONCISE_PROMPT`, :data:`EVAL_PROMPT` (:data:`STYLES` by name).
* :func:`parse_answer` reads a solution's final number, :func:`is_correct` compares it;
  :func:`segment_steps` re-paragraphs a solution one step per paragraph; :func:`trim_solution` cuts it
  after its first answer statement.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from steerkit.storage.datafiles import read_jsonl
from steerkit.errors import InputError

__all__ = ["Problem", "arithmetic_problems", "gsm8k_problems", "VERBOSE_PROMPT", "CONCISE_PROMPT", "EVAL_PROMPT",
           "STYLES", "ANSWER_RE", "parse_answer", "is_correct", "segment_steps", "trim_solution"]


@dataclass
class Problem:
    """A word problem with a numeric ``answer``; ``source`` is ``"arith"`` or ``"gsm8k"``.

    Examples:
        >>> from steerkit.probes.methods.problems import Problem
        >>> p = Problem("What is 2 + 3 * 4?", 14.0)
        >>> p.source, p.answer
        ('arith', 14.0)
    """

    question: str
    answer: float
    source: str = "arith"
    solution: str = ""


_NAMES = ["Tom", "Anna", "Sam", "Mia", "Ben", "Lisa", "Omar", "Kim", "Raj", "Eva", "Leo", "Zoe"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]


def _t_buy_give(r):
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(5, 30), r.randint(2, 20)
    c = r.randint(1, a + b - 1)
    return f"{n} has {a} {it}. {n} buys {b} more and then gives {c} to a friend. How many {it} does {n} have now?", a + b - c


def _t_packs(r):
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    a, b = r.randint(2, 9), r.randint(3, 12)
    c = r.randint(1, a * b - 1)
    return f"{n} buys {a} packs of {it} with {b} {it} in each pack and then loses {c} of them. How many {it} does {n} have left?", a * b - c


def _t_change(r):
    n = r.choice(_NAMES)
    p, a = r.randint(2, 9), r.randint(2, 6)
    bill = next(x for x in (10, 20, 50, 100) if x > p * a)
    return f"A shop sells notebooks for {p} dollars each. {n} buys {a} notebooks and pays with a {bill} dollar bill. How much change does {n} get?", bill - p * a


def _t_pages(r):
    n = r.choice(_NAMES)
    a, b, c = r.randint(5, 25), r.randint(2, 7), r.randint(3, 30)
    return f"{n} reads {a} pages a day for {b} days and then reads {c} more pages. How many pages does {n} read in total?", a * b + c


def _t_chairs(r):
    a, b = r.randint(3, 12), r.randint(4, 10)
    c = r.randint(1, a * b - 1)
    return f"A hall has {a} rows of chairs with {b} chairs in each row. Then {c} chairs are taken away. How many chairs are left?", a * b - c


def _t_money(r):
    n = r.choice(_NAMES)
    a, b, c = r.randint(20, 90), r.randint(3, 15), r.randint(5, 40)
    b = min(b, a - 1)
    return f"{n} has {a} dollars. {n} spends {b} dollars on lunch and then earns {c} dollars. How many dollars does {n} have now?", a - b + c


def _t_share(r):
    k, b, c = r.randint(2, 9), r.randint(2, 6), r.randint(1, 9)
    return f"{k * b} cookies are shared equally by {b} children. Then each child gets {c} more cookies. How many cookies does each child have?", k + c


def _t_expr(r):
    a, b, c, d = r.randint(2, 15), r.randint(2, 15), r.randint(2, 6), r.randint(1, 20)
    if r.random() < 0.5:
        return f"What is ({a} + {b}) * {c} - {d}?", (a + b) * c - d
    return f"What is {a} * {c} + {b} - {d}?", a * c + b - d


_TEMPLATES = {"medium": [_t_buy_give, _t_packs, _t_change, _t_pages, _t_chairs, _t_money, _t_share, _t_expr]}


def _e_sum3(r):
    a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
    return f"What is {a} + {b} + {c}?", a + b + c


def _e_buy_twice(r):
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
    return f"{n} has {a} {it}. {n} buys {b} more {it}, and then {c} more. How many {it} does {n} have now?", a + b + c


def _e_mul_add(r):
    a, b, c = r.randint(1, 9), r.randint(2, 5), r.randint(1, 9)
    return f"What is {a} + {b} * {c}?", a + b * c


def _e_give_twice(r):
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(1, 9), r.randint(1, 9), r.randint(1, 9)
    return (f"{n} has {a + b + c} {it}. {n} gives {a} {it} to a friend and {b} {it} to a neighbour. "
            f"How many {it} does {n} have left?"), c


def _e_add_sub(r):
    a, b = r.randint(2, 9), r.randint(2, 9)
    c = r.randint(1, a + b - 1)
    return f"What is {a} + {b} - {c}?", a + b - c


def _e_bags(r):
    n, it = r.choice(_NAMES), r.choice(_ITEMS)
    a, b, c = r.randint(2, 4), r.randint(2, 5), r.randint(1, 9)
    return f"{n} has {a} bags with {b} {it} in each bag and {c} more {it}. How many {it} does {n} have in total?", a * b + c


_TEMPLATES["easy"] = [_e_sum3, _e_buy_twice, _e_mul_add, _e_give_twice, _e_add_sub, _e_bags]


def arithmetic_problems(n: int = 60, seed: int = 0, *, level: str = "easy", exclude: Sequence[str] = ()) -> list[Problem]:
    """``n`` distinct templated multi-step (2-3 operations) arithmetic problems, templates cycled in a
    random order; deterministic in ``seed``. ``level``: ``"easy"`` (one-digit numbers, the level a
    135M model sometimes solves) or ``"medium"`` (two-digit numbers, change, rates, sharing). Questions
    in ``exclude`` are skipped (held-out sets: pass the training questions).

    Examples:
        >>> from steerkit.probes.methods.problems import arithmetic_problems
        >>> train = arithmetic_problems(3, seed=0)
        >>> test = arithmetic_problems(3, seed=1, exclude=[p.question for p in train])
        >>> len(train), not {p.question for p in train} & {p.question for p in test}, train == arithmetic_problems(3)
        (3, True, True)
    """
    if level not in _TEMPLATES:
        raise InputError(f"expected level in {sorted(_TEMPLATES)}, found {level!r}")
    templates = _TEMPLATES[level]
    r = random.Random(seed)
    seen = set(exclude)
    out: list[Problem] = []
    order = list(range(len(templates)))
    tries = 0
    while len(out) < n:
        if tries > 200 * max(n, 1):
            raise InputError(f"expected to find {n} distinct arithmetic problems, found only {len(out)}")
        tries += 1
        if len(out) % len(order) == 0:
            r.shuffle(order)
        q, a = templates[order[len(out) % len(order)]](r)
        if q in seen:
            continue
        seen.add(q)
        out.append(Problem(q, float(a), "arith"))
    return out


def gsm8k_problems(n: Optional[int] = None, *, offset: int = 0, path=None) -> list[Problem]:
    """GSM8K test problems (the vendored first 300, MIT; see ``steerkit/data/README.md``), rows
    ``offset .. offset + n``; ``path`` reads another jsonl with ``question`` / ``answer`` (``#### N``).

    Examples:
        >>> from steerkit.probes.methods.problems import gsm8k_problems
        >>> probs = gsm8k_problems(2)
        >>> len(probs), probs[0].source, probs[0].answer, "####" in probs[0].solution
        (2, 'gsm8k', 18.0, True)
    """
    rows = read_jsonl("reasoning/gsm8k_test_first300.jsonl", path=path, n=n, offset=offset,
                      what="GSM8K-style problems")
    out = []
    for i, r in enumerate(rows):
        sol = r.get("answer", "")
        m = re.search(r"####\s*(-?[\d,]*\.?\d+)", sol)
        if not m or not isinstance(r.get("question"), str):
            raise InputError(f"expected a question and an answer ending in '#### <number>' in row {offset + i}, "
                             f"found {str(r)[:80]!r}")
        out.append(Problem(r["question"], float(m.group(1).replace(",", "")), "gsm8k", sol))
    return out


VERBOSE_PROMPT = ("{question}\nExplain your reasoning in detail, step by step, and finish with "
                  "'The answer is <number>.'")
CONCISE_PROMPT = ("{question}\nBe brief: give only the key calculation in one short line, then "
                  "'The answer is <number>.'")
EVAL_PROMPT = "{question}\nSolve the problem step by step and finish with 'The answer is <number>.'"
STYLES = {"verbose": VERBOSE_PROMPT, "concise": CONCISE_PROMPT, "eval": EVAL_PROMPT}
_STOP = ("\nQuestion:",)  # a model that goes on with a new problem

_NUM = r"-?\$?\s?-?[\d,]*\.?\d+"
ANSWER_RE = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*(" + _NUM + ")", re.IGNORECASE)


def _num(s: str) -> Optional[float]:
    s = s.replace("$", "").replace(",", "").replace(" ", "")
    try:
        return float(s.rstrip("."))
    except ValueError:
        return None


def parse_answer(text: str) -> Optional[float]:
    """The final number of a solution: the first ``answer is N`` (or ``answer: N``), else ``#### N``,
    else ``\\boxed{N}``, else the last number in the text; ``None`` when there is no number.

    Examples:
        >>> from steerkit.probes.methods.problems import parse_answer
        >>> parse_answer("3 + 4 = 7, so the answer is 7."), parse_answer("#### 1,250"), parse_answer("no idea")
        (7.0, 1250.0, None)
    """
    m = ANSWER_RE.search(text)
    if m:
        v = _num(m.group(1))
        if v is not None:
            return v
    for pat in (r"####\s*(" + _NUM + ")", r"\\boxed\{\s*(" + _NUM + r")\s*\}"):
        m = re.search(pat, text)
        if m and _num(m.group(1)) is not None:
            return _num(m.group(1))
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    for s in reversed(nums):
        v = _num(s)
        if v is not None:
            return v
    return None


def is_correct(text: str, answer: float, tol: float = 1e-6) -> bool:
    """Whether the number :func:`parse_answer` finds in ``text`` equals ``answer`` (relative ``tol``).

    Examples:
        >>> from steerkit.probes.methods.problems import is_correct
        >>> is_correct("The answer is 14.", 14), is_correct("The answer is 13.", 14), is_correct("", 14)
        (True, False, False)
    """
    v = parse_answer(text)
    return v is not None and abs(v - float(answer)) <= tol * max(1.0, abs(float(answer)))


_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(])")


def segment_steps(text: str) -> str:
    """The solution with one step per paragraph: split at line breaks and at sentence ends, each step
    followed by a blank line, so that a step boundary follows every step, the last one included (a
    short solution often has no blank line of its own; the last boundary is where a verbose solution
    goes on and a concise one stops).

    Examples:
        >>> from steerkit.probes.methods.problems import segment_steps
        >>> segment_steps("First 3 * 4 = 12. Then 2 + 12 = 14.\\nThe answer is 14.").split("\\n\\n")
        ['First 3 * 4 = 12.', 'Then 2 + 12 = 14.', 'The answer is 14.', '']
    """
    steps = []
    for line in re.split(r"\n+", text):
        steps += [x.strip() for x in _SENT.split(line.strip()) if x.strip()]
    return "".join(x + "\n\n" for x in steps)


def trim_solution(text: str) -> str:
    """The solution up to and including its first answer statement (a few-shot prompt invites the
    model to go on with another question).

    Examples:
        >>> from steerkit.probes.methods.problems import trim_solution
        >>> trim_solution("4 * 6 = 24. The answer is 24. Question: next")
        '4 * 6 = 24. The answer is 24.'
    """
    for s in _STOP:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    m = ANSWER_RE.search(text)
    if m:
        end = m.end()
        if end < len(text) and text[end] == ".":
            end += 1
        text = text[:end]
    return text.rstrip()
