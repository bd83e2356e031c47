"""Generation with the KV cache, under steerkit's hooks.

The loop is steerkit's own (not ``model.generate``), so that every step runs
through the backend under one :class:`~steerkit.hooks.positions.RunState`: hooks
know which positions are prompt and which are generated, edits apply to
generated tokens as well, and tokens can be streamed. Prompts are
left-padded; position ids come from the attention mask. When a record scope
asks for generated positions, one extra step feeds the last sampled token, so
the cache holds one row per generated token.

Greedy decoding gives the same tokens as ``transformers``' ``generate``.

Two generation options of Qian et al. (NeurIPS 2025, "thinking tokens are information peaks"):

* ``recycle=Recycle(layer, tokens)`` (*representation recycling*): at a step whose greedy/sampled
  next token is a thinking token, the step is run again with block ``layer`` applied twice at
  the newest position (its output from the first run replaces its input at that position, the
  reference code's extract/inject hooks), and the token of the re-run is kept. The KV cache is
  cropped back before the re-run, so the cache holds the recycled keys and values; the hooks'
  position tracking is told the re-run repeats the same positions (``RunState.chunk_start``),
  and a record scope keeps the re-run's rows.
* :func:`continue_thinking` (*thinking-token continuation*, TTTS): after the answer, append a
  thinking word ("Wait", "Therefore", ...) and keep generating, then ask for the final answer.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.reuse import RunCache, run_from, start_block, supports_run_from
from steerkit.errors import InputError, SteerkitError

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_prompts(prompts) -> None:
    """Refuse what can never be a prompt batch (``None``, a number, bytes) before tokenizing.

    Examples:
        >>> check_prompts(["hello", "world"])
        >>> check_prompts(None)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a prompt string or a list of prompt strings, found None
    """
    if prompts is None:
        raise InputError("expected a prompt string or a list of prompt strings, found None")
    if isinstance(prompts, (bytes, bytearray)) or _is_real(prompts) or isinstance(prompts, (bool, dict)):
        raise InputError(f"expected a prompt string or a list of prompt strings, found "
                         f"{type(prompts).__name__}: {prompts!r:.80}")


def check_generate_args(sm: "SteerModel", prompts, *, max_new_tokens, do_sample, temperature, top_p, top_k,
                        seed, stop, stream) -> tuple[str, ...]:
    """Check :func:`generate`'s arguments before any work; returns ``stop`` as a tuple of strings.

    Examples:
        >>> kw = dict(max_new_tokens=4, do_sample=False, temperature=1.0, top_p=1.0, top_k=0, seed=None, stream=None)
        >>> check_generate_args(tiny, ["hi"], stop=".", **kw), check_generate_args(tiny, "hi", stop=[".", "!"], **kw)
        (('.',), ('.', '!'))
    """
    check_prompts(prompts)
    if not _is_int(max_new_tokens):
        raise InputError(f"expected max_new_tokens as an integer >= 1, found {type(max_new_tokens).__name__}: "
                         f"{max_new_tokens!r}")
    if max_new_tokens < 1:
        raise InputError(f"expected max_new_tokens >= 1, found {max_new_tokens}")
    if sm.n_ctx is not None and max_new_tokens > sm.n_ctx:
        raise InputError(f"expected max_new_tokens <= {sm.n_ctx} (the model's context), found {max_new_tokens}; "
                         "lower max_new_tokens")
    if do_sample not in (True, False):
        raise InputError(f"expected do_sample as True or False, found {type(do_sample).__name__}: {do_sample!r}")
    if not _is_real(temperature) or not math.isfinite(temperature):
        raise InputError(f"expected temperature as a finite number (> 0 when sampling), found {temperature!r}")
    if do_sample and temperature <= 0:
        raise InputError(f"expected temperature > 0 when sampling (do_sample=True), found {temperature}; use "
                         "do_sample=False for greedy decoding")
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:
        raise InputError(f"expected top_p in (0, 1] (1: no nucleus cut), found {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise InputError(f"expected top_k as an integer >= 0 (0: no top-k cut), found {top_k!r}")
    if seed is not None and not _is_int(seed):
        raise InputError(f"expected seed as an integer or None, found {type(seed).__name__}: {seed!r}")
    if stream is not None and not callable(stream):
        raise InputError(f"expected stream as a callable stream(row, token_id, text) or None, found "
                         f"{type(stream).__name__}")
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stops = tuple(stop)
    except TypeError:
        raise InputError(f"expected stop as a string or a list of strings, found {type(stop).__name__}") from None
    bad = [s for s in stops if not isinstance(s, str) or not s]
    if bad:
        raise InputError(f"expected stop strings to be non-empty strings, found {bad[0]!r}")
    return stops


def _sample(logits: Tensor, do_sample: bool, temperature: float, top_p: float, top_k: int,
            gen: torch.Generator | None) -> Tensor:
    if not do_sample:
        return logits.argmax(-1)
    if temperature <= 0:
        raise InputError(f"expected temperature > 0 when sampling, found {temperature}")
    logits = logits.float() / temperature
    if top_k and top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sl, si = logits.sort(-1, descending=True)
        cp = sl.softmax(-1).cumsum(-1)
        drop = cp - sl.softmax(-1) > top_p
        sl = sl.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, si, sl)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@dataclass
class Recycle:
    """Representation recycling at block ``layer`` on steps whose next token is in ``tokens``.

    ``tokens``: token ids, or words (each word's token ids with and without a leading space are
    used, when the word is a single token). ``prob``: chance of recycling a qualifying step (the
    reference code uses 0.5; default 1.0, deterministic); ``seed`` seeds that draw. ``events``
    is filled during generation with ``(row, step)`` of every recycled step.

    Examples:
        >>> every = Recycle(layer=1, tokens=list(range(len(tiny.tokenizer))))  # every step qualifies
        >>> out = tiny.generate(["Hi"], max_new_tokens=3, chat=False, recycle=every)
        >>> len(out), every.events
        (1, [(0, 0), (0, 1), (0, 2)])
        >>> len(Recycle(layer=1, tokens=["Wait"]).token_ids(tiny.tokenizer)) >= 1
        True
    """

    layer: int
    tokens: Sequence
    prob: float = 1.0
    seed: Optional[int] = None
    events: list = field(default_factory=list)

    def token_ids(self, tokenizer) -> set[int]:
        ids = {int(t) for t in self.tokens if isinstance(t, int)}
        words = [t for t in self.tokens if not isinstance(t, int)]
        for t in words:
            if not isinstance(t, str) or not t.strip():
                raise InputError(f"expected thinking tokens as ids or non-empty words, found {t!r}")
        found, missing = single_token_ids(tokenizer, words)
        if missing:
            t = missing[0]
            raise InputError(f"expected each thinking word to be a single token, found {t!r} -> "
                             f"{tokenizer.tokenize(t)}; pass token ids for multi-token words")
        return ids | set(found)


def single_token_ids(tokenizer, words: Sequence[str]) -> tuple[list[int], list[str]]:
    """``(ids, missing)``: the ids of the single-token forms of ``words`` (as written, and with one
    leading space), in order and without repeats, and the words that have no single-token form.

    Examples:
        >>> ids, missing = single_token_ids(tiny.tokenizer, ["Wait", "Therefore", "antidisestablishmentarianism"])
        >>> len(ids) >= 2, missing
        (True, ['antidisestablishmentarianism'])
    """
    ids: list[int] = []
    missing: list[str] = []
    for w in words:
        forms = [tokenizer.encode(f, add_special_tokens=False) for f in (w, " " + w.lstrip())]
        singles = [int(e[0]) for e in forms if len(e) == 1]
        if not singles:
            missing.append(w)
        ids += [i for i in singles if i not in ids]
    return ids, missing


class _Recycler:
    """The extract (block output) and inject (block input) edits of one generate call."""

    def __init__(self, sm: "SteerModel", spec: Recycle):
        if not 0 <= int(spec.layer) < sm.n_layers:
            raise InputError(f"expected a recycle layer in [0, {sm.n_layers}), found {spec.layer}")
        if not 0.0 <= spec.prob <= 1.0:
            raise InputError(f"expected a recycle probability in [0, 1], found {spec.prob}")
        self.sm, self.spec = sm, spec
        self.ids = spec.token_ids(sm.tokenizer)
        self.rng = random.Random(spec.seed)
        self.out: Optional[Tensor] = None  # [batch, d_model] block output at the newest position
        self.rows: Optional[Tensor] = None  # [batch] bool: rows injected in the re-run

    def _extract(self, x: Tensor) -> Tensor:
        if self.rows is None:
            self.out = x[:, -1].clone()
        return x

    def _inject(self, x: Tensor) -> Tensor:
        if self.rows is None:
            return x
        if self.out is None:
            raise SteerkitError("expected the recycled block's output from the first run of this step before "
                                "the re-run, found none; representation recycling re-runs a step only after "
                                "running it once, so this is a steerkit bug to report")
        y = x.clone()
        y[self.rows, -1] = self.out[self.rows].to(y.dtype)
        return y

    def scope(self):
        l = int(self.spec.layer)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.sm.edit(f"blocks.{l}.hook_resid_post", fn=self._extract))
            stack.enter_context(self.sm.edit(f"blocks.{l}.hook_resid_pre", fn=self._inject))
        except BaseException:
            stack.close()
            raise
        return stack

    def select(self, nxt: Tensor, done: Tensor) -> Optional[Tensor]:
        rows = torch.tensor([not bool(done[b]) and int(nxt[b]) in self.ids and
                             (self.spec.prob >= 1.0 or self.rng.random() < self.spec.prob)
                             for b in range(nxt.shape[0])], dtype=torch.bool, device=nxt.device)
        return rows if bool(rows.any()) else None


def _crop(backend, cache, keep: int):
    """The KV cache cut back to its first ``keep`` positions (a fresh cache for 0)."""
    if keep == 0:
        return backend.new_cache()
    extra = int(cache.get_seq_length()) - keep
    if extra > 0:
        cache.crop(-extra)  # negative: remove that many (transformers 4.x and 5.x alike)
    return cache


def _select_rows(backend, cache, index: Tensor):
    """A new cache holding rows ``index`` of ``cache`` (``cache`` itself is left as it is)."""
    out = backend.new_cache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.index_select(0, index), layer.values.index_select(0, index), i)
    return out


@torch.inference_mode()
def continuation_logprobs(sm: "SteerModel", prompts: Sequence[Sequence[int]],
                          rows: Sequence[tuple[int, Sequence[int]]], *, batch_size: int = 64,
                          progress: Callable[[int], None] | None = None) -> list[Float[Tensor, " k"]]:
    """Per row ``(prompt index, continuation token ids)``: the log-probability ``[k]`` (float32, CPU) of each
    continuation token after its prompt and the tokens before it, under the model as it is, as a
    generation would have seen those tokens: the hooks on ``sm`` are active, the prompt is the prompt
    and the continuation tokens are generated positions (an edit with ``positions="generated"`` reaches
    them; ``"last"`` and negative indices refer to the prompt). With no edits, or edits at every
    position, it equals the log-softmax of :meth:`SteerModel.forward` on prompt + continuation, up to
    float rounding.

    Each prompt's KV cache is computed once (``batch_size`` prompts a pass) and shared by every row that
    continues it; a row's pass feeds only its continuation, and only those positions go through the
    unembedding. ``progress(n)`` is called with the number of rows each pass completed.

    Examples:
        >>> ids = [tiny.tokenizer("a b c")["input_ids"], tiny.tokenizer("d")["input_ids"]]
        >>> lp = continuation_logprobs(tiny, ids, [(0, [5, 6]), (1, [7]), (0, [])])
        >>> [tuple(x.shape) for x in lp], bool((lp[0] <= 0).all())
        ([(2,), (1,), (0,)], True)
    """
    n_prompts = len(prompts)
    for r, (p, _) in enumerate(rows):
        if not (_is_int(p) and 0 <= int(p) < n_prompts):
            raise InputError(f"expected row {r}'s prompt index in [0, {n_prompts}), found {p!r}")
    out: list = [torch.zeros(0) for _ in rows]
    by_prompt: dict[int, list[int]] = {}
    for r, (p, cont) in enumerate(rows):
        if len(cont):
            by_prompt.setdefault(int(p), []).append(r)
    if progress is not None and len(rows) > sum(len(v) for v in by_prompt.values()):
        progress(len(rows) - sum(len(v) for v in by_prompt.values()))
    backend = sm.backend
    pad = sm.tokenizer.pad_token_id
    used = sorted(by_prompt)
    for i0 in range(0, len(used), batch_size):
        chunk = used[i0:i0 + batch_size]
        toks = sm.pad([prompts[p] for p in chunk])
        P, dev = toks.input_ids.shape[1], toks.input_ids.device
        with sm.hooks.runs.running(toks.attention_mask, toks.input_ids) as run:
            run.generating = True
            last, cache = backend.step(toks.input_ids, toks.attention_mask, toks.position_ids, backend.new_cache())
        first = torch.log_softmax(last.float(), dim=-1)  # each prompt's distribution of its first continuation token
        local = {p: j for j, p in enumerate(chunk)}
        todo = [r for p in chunk for r in by_prompt[p]]
        longest = max(len(rows[r][1]) for r in todo)
        size = max(1, min(batch_size, (1 << 27) // max(1, (longest - 1) * first.shape[-1])))
        for j0 in range(0, len(todo), size):
            part = todo[j0:j0 + size]
            conts = [list(rows[r][1]) for r in part]
            idx = torch.tensor([local[int(rows[r][0])] for r in part], device=dev)
            t0 = torch.tensor([c[0] for c in conts], device=dev)
            head = first.index_select(0, idx).gather(-1, t0[:, None])[:, 0]
            T = max(len(c) for c in conts) - 1  # fed: every continuation token but the last
            if T > 0:
                fill = [[pad] * (T + 1 - len(c)) for c in conts]
                feed = torch.tensor([c[:-1] + f for c, f in zip(conts, fill)], device=dev)
                nxt = torch.tensor([c[1:] + f for c, f in zip(conts, fill)], device=dev)  # what each fed token predicts
                fmask = torch.tensor([[1] * (len(c) - 1) + [0] * len(f) for c, f in zip(conts, fill)],
                                     dtype=toks.attention_mask.dtype, device=dev)
                pmask = toks.attention_mask.index_select(0, idx)
                pos = toks.position_ids.index_select(0, idx)[:, -1:] + 1 + torch.arange(T, device=dev)[None]
                with sm.hooks.runs.running(pmask, toks.input_ids.index_select(0, idx)) as run:
                    run.generating, run.chunk_start = True, P
                    run.append_tokens(feed)
                    logits, _ = backend.step(feed, torch.cat([pmask, fmask], 1), pos,
                                             _select_rows(backend, cache, idx), keep=0)
                logits = logits.float()
                rest = logits.gather(-1, nxt[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
            for i, (r, c) in enumerate(zip(part, conts)):
                out[r] = (torch.cat([head[i:i + 1], rest[i, :len(c) - 1]]) if T > 0 else head[i:i + 1]).cpu()
            if progress is not None:
                progress(len(part))
    return out


def _wants_generated_rows(sm: "SteerModel") -> bool:
    return any(getattr(h, "records_generated", False) for h in sm.hooks.handles)


def _eos_ids(sm: "SteerModel") -> set:
    eos = sm.tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    gcfg = getattr(sm.hf_model, "generation_config", None)
    if gcfg is not None and gcfg.eos_token_id is not None:
        e = gcfg.eos_token_id
        eos_ids |= set(e if isinstance(e, (list, tuple)) else [e])
    return eos_ids


def _check_room(sm: "SteerModel", P: int, max_new_tokens: int) -> None:
    if sm.n_ctx is not None and P + max_new_tokens > sm.n_ctx:
        raise InputError(f"expected prompt + max_new_tokens <= {sm.n_ctx} (the model's context), found "
                         f"{P} + {max_new_tokens}; lower max_new_tokens or shorten the prompts")


@torch.inference_mode()
def generate(sm: "SteerModel", prompts, *, max_new_tokens: int = 32, chat: bool = False, do_sample: bool = False,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
             seed: int | None = None, stream: Callable | None = None, return_tokens: bool = False,
             recycle: Recycle | None = None):
    """Generate up to ``max_new_tokens`` per prompt; returns a list of strings (or token lists).

    ``stream(row, token_id, text_so_far)`` is called for every new token. A row stops at
    its EOS token or when its text contains one of ``stop`` (the stop string is cut off).
    ``recycle``: representation recycling on thinking tokens (see :class:`Recycle`). Text prompts
    are continued as raw text by default; ``chat=True`` puts each in the chat template (a reply).
    :func:`generate_from` generates from a prompt pass already made, running only the blocks from
    the one a steering acts at in the prompt pass.

    Examples:
        >>> generate(sm, ["What is the capital of France?"], max_new_tokens=8, chat=True)
        ['The capital of France is Paris.']
        >>> [len(t) for t in generate(tiny, ["a", "b c"], max_new_tokens=5, chat=False, return_tokens=True)]
        [5, 5]
    """
    stop = check_generate_args(sm, prompts, max_new_tokens=max_new_tokens, do_sample=do_sample,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                               stream=stream)
    toks = sm.tokenize(prompts, chat=chat)
    _check_room(sm, int(toks.input_ids.shape[1]), max_new_tokens)
    rec = _Recycler(sm, recycle) if recycle is not None else None

    def prefill(run):
        if rec is not None:
            run.chunk_start = 0
        return sm.backend.step(toks.input_ids, toks.attention_mask, toks.position_ids, sm.backend.new_cache())

    with rec.scope() if rec is not None else contextlib.nullcontext():
        out = _decode(sm, toks, prefill, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                      top_p=top_p, top_k=top_k, stop=stop, seed=seed, stream=stream, rec=rec, placed=rec is not None)
    return _finish(sm, out, stop, return_tokens)


@torch.inference_mode()
def generate_from(sm: "SteerModel", site, cache, rows: Optional[Sequence[int]] = None, *, max_new_tokens: int = 32,
                  do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  stop: Sequence[str] = (), seed: int | None = None, stream: Callable | None = None,
                  return_tokens: bool = False):
    """:func:`generate` from a prompt pass already made: ``cache`` (a :class:`steerkit.reuse.RunCache` of
    the prompts, :func:`steerkit.reuse.run_cached`), its rows ``rows`` (repeats allowed; default all).
    The prompt pass runs blocks ``site ..`` only (an index or a hook name inside the block, as
    :func:`steerkit.reuse.run_from` takes), block ``site`` receiving the cached residual and the blocks
    below it taking the cached keys and values; every decoding step then runs the whole model. With
    every edit in force acting at block ``site`` or later, the tokens equal :func:`generate`'s on the same
    prompts with the same edits (float rounding aside); recordings at blocks ``site ..`` equal it too,
    and sites below block ``site`` record the generated positions only (they do not run on the prompt).
    Only the ``hf`` backend runs a range of blocks (:func:`steerkit.reuse.supports_run_from`). The other
    arguments are :func:`generate`'s; representation recycling is not offered here.

    Examples:
        >>> from steerkit.generation import generate_from
        >>> from steerkit.reuse import run_cached
        >>> toks = tiny.tokenize(["Hi", "Tell me a joke"])
        >>> rc = run_cached(tiny, toks)  # the unsteered prompt pass, once
        >>> add = steerkit.Intervention.add("blocks.1.hook_resid_pre", torch.ones(64), 4.0)
        >>> with tiny.steer(add):
        ...     fast = generate_from(tiny, 1, rc, max_new_tokens=4, return_tokens=True)
        >>> fast == tiny.generate(toks, max_new_tokens=4, steering=add, return_tokens=True)
        True
    """
    if not supports_run_from(sm):
        raise InputError(f"expected a model on the 'hf' backend to start a prompt pass at a block, found backend "
                         f"{sm.backend_name!r}; use generate")
    if not isinstance(cache, RunCache):
        raise InputError(f"expected a RunCache from run_cached(sm, prompts), found {type(cache).__name__}")
    cache.check(sm)
    stop = check_generate_args(sm, [""], max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                               top_p=top_p, top_k=top_k, seed=seed, stop=stop, stream=stream)
    layer = start_block(sm, site)
    toks, idx = cache.select(rows)
    _check_room(sm, cache.n_pos, max_new_tokens)

    def prefill(run):
        logits, kv = run_from(sm, layer, cache, rows=idx.tolist(), keep=1, return_cache=True, within_run=True)
        return logits[:, -1], kv

    out = _decode(sm, toks, prefill, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                  top_p=top_p, top_k=top_k, stop=stop, seed=seed, stream=stream, rec=None, placed=True)
    return _finish(sm, out, stop, return_tokens)


def _decode(sm: "SteerModel", toks, prefill: Callable, *, max_new_tokens: int, do_sample: bool, temperature: float,
            top_p: float, top_k: int, stop: tuple, seed, stream, rec: Optional[_Recycler],
            placed: bool) -> list[list[int]]:
    """The generation loop over the left-padded prompts ``toks``: ``prefill(run)`` runs the prompt pass and
    returns its last position's logits and the KV cache; each decoding step feeds the sampled tokens.
    ``placed``: tell the hooks where each decoding step's positions are (``RunState.chunk_start``), for
    sites that did not see the prompt pass or saw a step twice."""
    B, P = toks.input_ids.shape
    dev = toks.input_ids.device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev).manual_seed(int(seed))
    eos_ids = _eos_ids(sm)
    pad = sm.tokenizer.pad_token_id
    out: list[list[int]] = [[] for _ in range(B)]
    done_l = [False] * B
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    texts = [""] * B
    mask = toks.attention_mask
    backend = sm.backend
    with sm.hooks.runs.running(toks.attention_mask, toks.input_ids) as run:
        run.generating = True
        last_in = (toks.input_ids, mask, toks.position_ids, 0)  # what the step that made ``logits`` fed, and where
        logits, cache = prefill(run)
        next_pos = toks.position_ids[:, -1:] + 1
        for step in range(max_new_tokens):
            nxt = _sample(logits, do_sample, temperature, top_p, top_k, gen)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            rows = rec.select(nxt, done) if rec is not None else None
            if rec is not None and rows is not None:  # re-run the step with the block applied twice on these rows
                ids_in, mask_in, pos_in, start = last_in
                cache = _crop(backend, cache, start)
                run.chunk_start, rec.rows = start, rows
                try:
                    again, cache = backend.step(ids_in, mask_in, pos_in, cache)
                finally:
                    rec.rows = None
                logits = torch.where(rows[:, None], again, logits)
                nxt = torch.where(rows, _sample(logits, do_sample, temperature, top_p, top_k, gen), nxt)
                rec.spec.events.extend((int(b), step) for b in rows.nonzero().flatten().tolist())
            # the sampled tokens leave the device in one copy per step; which rows ended is kept on the host
            fed_l = [not d for d in done_l]  # the rows whose token this step is a generated one (fed next)
            for b, t in enumerate(nxt.tolist()):
                if done_l[b]:
                    continue
                if t in eos_ids:
                    done_l[b] = True
                    fed_l[b] = False
                    continue
                out[b].append(t)
                if stream is not None or stop:
                    texts[b] = sm.tokenizer.decode(out[b], skip_special_tokens=True)
                if stream is not None:
                    stream(b, t, texts[b])
                if stop and any(s in texts[b] for s in stop):
                    done_l[b] = True
            last = step == max_new_tokens - 1
            if all(done_l) or (last and not _wants_generated_rows(sm)):
                break
            done = torch.tensor(done_l, dtype=torch.bool, device=dev)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=dev)], 1)
            run.append_tokens(nxt.unsqueeze(1))  # token-pattern position specs read the fed ids
            # rows that ended are fed padding: none of it is selected
            run.live = None if all(fed_l) else torch.tensor(fed_l, dtype=torch.bool, device=dev)
            if placed:
                run.chunk_start = P + step
            last_in = (nxt.unsqueeze(1), mask, next_pos, P + step)
            logits, cache = backend.step(nxt.unsqueeze(1), mask, next_pos, cache)
            next_pos = next_pos + 1
    return out


def _finish(sm: "SteerModel", out: list[list[int]], stop: tuple, return_tokens: bool):
    """The generated token lists, or their texts with each stop string and what follows it cut off."""
    if return_tokens:
        return out
    res = []
    for toks in out:
        txt = sm.tokenizer.decode(toks, skip_special_tokens=True)
        for s in stop:
            i = txt.find(s)
            if i >= 0:
                txt = txt[:i]
        res.append(txt)
    return res


@dataclass
class Continuation:
    """The three parts of a thinking-token continuation, one entry per prompt.

    Examples:
        >>> c = Continuation(["7."], [" it is 7."], [" 7"], "Wait", " Final answer:")
        >>> c.texts
        ['7. Wait it is 7. Final answer: 7']
    """

    answer: list[str]  # the first greedy answer
    continued: list[str]  # what the model wrote after the thinking word
    final: list[str]  # its reply to the final-answer prompt ("" when none was asked)
    word: str
    final_prompt: Optional[str]

    @property
    def texts(self) -> list[str]:
        """The whole response: answer, thinking word, continuation, final prompt and final answer."""
        fp = self.final_prompt or ""
        return [f"{a} {self.word}{c}{fp}{f}"
                for a, c, f in zip(self.answer, self.continued, self.final)]


def continue_thinking(sm: "SteerModel", prompts, word: str = "Wait", *, max_new_tokens: int = 256, continue_tokens: int = 256,
                      final_prompt: Optional[str] = " Final answer:", final_tokens: int = 16, chat: bool = False,
                      **gen_kw) -> Continuation:
    """Thinking-token continuation (Qian et al. 2025, "TTTS"): generate an answer, append
    ``" " + word`` (a thinking token such as "Wait", "Hmm", "Therefore") and continue for up to
    ``continue_tokens``, then append ``final_prompt`` and generate ``final_tokens`` for the final
    answer (skipped when ``final_prompt`` is None). Every stage works on token ids, so the
    continuation sees exactly the tokens the model produced; other keyword arguments go to
    :func:`generate` at every stage (sampling, ``recycle``, ...). ``chat=True`` puts each prompt in
    the chat template first (the default continues the raw text, as :func:`generate` does).

    Examples:
        >>> c = continue_thinking(tiny, ["What is 12 + 7?", "Name a color."], "Wait", max_new_tokens=4,
        ...                       continue_tokens=3, final_tokens=2)
        >>> len(c.answer), len(c.continued), len(c.final), c.word
        (2, 2, 2, 'Wait')
        >>> c.texts[0].startswith(c.answer[0] + " Wait")
        True

        On a trained model (``sm``), ``max_new_tokens=256`` lets the first answer finish before "Wait".
    """
    if not isinstance(word, str) or not word.strip():
        raise InputError(f"expected a non-empty thinking word, found {word!r}")
    check_prompts(prompts)
    toks = sm.tokenize(prompts, chat=chat)
    rows = [toks.input_ids[b][toks.attention_mask[b].bool()].tolist() for b in range(len(toks))]
    answer = generate(sm, toks, max_new_tokens=max_new_tokens, return_tokens=True, **gen_kw)

    def enc(s: str) -> list[int]:
        return sm.tokenizer.encode(s, add_special_tokens=False)

    ids = [r + a + enc(" " + word.strip()) for r, a in zip(rows, answer)]
    cont = generate(sm, sm.pad(ids), max_new_tokens=continue_tokens, return_tokens=True, **gen_kw)
    final: list[list[int]] = [[] for _ in rows]
    if final_prompt:
        ids = [i + c + enc(final_prompt) for i, c in zip(ids, cont)]
        final = generate(sm, sm.pad(ids), max_new_tokens=final_tokens, return_tokens=True, **gen_kw)

    def dec(xs: list[list[int]]) -> list[str]:
        return [sm.tokenizer.decode(x, skip_special_tokens=True) for x in xs]

    return Continuation(dec(answer), dec(cont), dec(final), word.strip(), final_prompt)
