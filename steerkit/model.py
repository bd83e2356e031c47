"""``SteerModel``: a causal LM, its tokenizer, its adapter, a backend and a hook manager.

``load_model`` resolves the model offline (see :mod:`steerkit.loading.resolve`), picks
the adapter for its architecture, and wraps the chosen backend. Every forward
pass and generation step runs through the backend under a
:class:`~steerkit.hooks.positions.RunState`, so hooks know which positions are real
prompt tokens, padding, or generated tokens. Prompts are left-padded and
position ids come from the attention mask, so a padded row computes exactly
what it computes alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable, Iterable, Iterator, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.hooks import names as hooknames
from steerkit.loading.device import pick_device, pick_dtype
from steerkit.loading.resolve import load_hf, resolve
from steerkit.loading.adapters import Adapter, adapter_for
from steerkit.backends import BACKENDS
from steerkit.backends.hf import HFBackend
from steerkit.backends.nnsight import NNsightBackend
from steerkit.backends.tlens import TLensBackend
from steerkit.errors import InputError
from steerkit.loading.fingerprint import model_fingerprint
from steerkit.generation import check_generate_args, check_prompts
from steerkit.generation import generate as _generate
from steerkit.hooks.manager import HookHandle, HookManager, RecordHandle
from steerkit import saesites
from steerkit.saesites import SAEHandle
from steerkit.interventions import KERNEL_OPS, CompiledSteering, Intervention, ModelFacts, compile_steering, lower
from steerkit.hooks.positions import PositionSpec
from steerkit.loading.quantize import SCHEMES, scheme_of
from steerkit.loading.quantize import quantize as quantize_weights
from steerkit import reuse
from steerkit.reuse import RunCache

Prompts = Union[str, Sequence[str]]


def per_row_steering(steering) -> bool:
    """Whether ``steering`` is a list in the old per-row form (a list is one steering per batch row
    unless every element is an :class:`Intervention`); pass ``rows=[...]`` instead.

    Examples:
        >>> add = Intervention.add("blocks.0.hook_resid_post", torch.ones(64))
        >>> per_row_steering([add, add]), per_row_steering([[add], None])
        (False, True)
    """
    return isinstance(steering, (list, tuple)) and bool(steering) and not all(
        isinstance(s, Intervention) for s in steering)


def _rows_of(steering, rows, where: str, keyword: str = "rows"):
    """``(steering, rows)`` with the old per-row list (``steering=[a, b]`` of artifacts, dicts, lists or
    ``None``) moved to ``rows`` under a :class:`DeprecationWarning` naming ``keyword``."""
    if rows is not None:
        if steering is not None:
            raise InputError(f"expected either a steering for every row or {keyword}= (one steering per row), "
                             f"found both in {where}")
        if not isinstance(rows, (list, tuple)) or not rows:
            raise InputError(f"expected {keyword}= as a non-empty list with one steering (or None) per row, found "
                             f"{type(rows).__name__}")
        return None, list(rows)
    if per_row_steering(steering):
        warnings.warn(f"{where}: a list of steerings as one per batch row is deprecated; pass {keyword}=[...] "
                      "(a list of Interventions is one steering, composed)", DeprecationWarning, stacklevel=3)
        return None, list(steering)
    return steering, None


EDIT_OPS: dict[str, Callable] = {
    "add": lambda h, t, scale, value, pos, **kw: Intervention.add(h, t, scale, positions=pos, **kw),
    "ablate": lambda h, t, scale, value, pos, **kw: Intervention.ablate(h, t, scale, positions=pos, **kw),
    "clamp": lambda h, t, scale, value, pos, **kw: Intervention.clamp(h, t, value, positions=pos, **kw),
    "replace": lambda h, t, scale, value, pos, **kw: Intervention.replace(h, t, scale, positions=pos, **kw),
    "fn": lambda h, t, scale, value, pos, **kw: _apply_on(h, t, pos, **kw),
}


def _apply_on(site: str, fn, positions, heads=None, neurons=None) -> Intervention:
    iv = Intervention.apply(site, fn, positions=positions)
    return iv if heads is None and neurons is None else dataclasses.replace(iv, heads=heads, neurons=neurons)


class Tokens:
    """A tokenized, left-padded batch: ``input_ids`` and ``attention_mask`` ``[batch, pos]``.

    Examples:
        >>> t = tiny.pad([[5, 6, 7], [8]])
        >>> len(t), t.attention_mask.tolist(), t.position_ids.tolist()
        (2, [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """

    def __init__(self, input_ids: Tensor, attention_mask: Tensor):
        self.input_ids = input_ids
        self.attention_mask = attention_mask

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def __len__(self):
        return int(self.input_ids.shape[0])


class SteerModel:
    """A model ready to be recorded and steered. Build it with :func:`steerkit.load_model`.

    Examples:
        >>> sm
        SteerModel('HuggingFaceTB/SmolLM2-135M-Instruct', backend='hf', n_layers=30, d_model=576, adapter='llama')
        >>> with sm.record("blocks.15.hook_resid_post", positions="last") as cache:
        ...     _ = sm.forward(["I love this", "I hate this"])
        >>> v = cache["blocks.15.hook_resid_post"][0] - cache["blocks.15.hook_resid_post"][1]
        >>> tuple(v.shape)
        (576,)
        >>> with sm.edit("blocks.15.hook_resid_post", add=v, scale=4.0):
        ...     out = sm.generate(["Tell me about your day"], max_new_tokens=4)
        >>> len(out), isinstance(out[0], str)
        (1, True)
    """

    def __init__(self, model, tokenizer, *, name: str, backend: str = "hf", adapter: Adapter | None = None,
                 source_gguf=None, hf_model=None, fingerprint: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.source_gguf = source_gguf
        self.hf_model = hf_model if hf_model is not None else model
        self._fingerprint = fingerprint
        #: the weight-only quantisation of the model ("int8", "int4"), None for none
        self.quantization = scheme_of(self.hf_model)
        self.adapter = adapter or adapter_for(self.hf_model)
        self.n_layers = self.adapter.n_layers(self.hf_model)
        self.d_model = self.adapter.d_model(self.hf_model)
        self.n_heads = self.adapter.n_heads(self.hf_model)
        self.n_kv_heads = self.adapter.n_kv_heads(self.hf_model)
        self.d_head = self.adapter.d_head(self.hf_model)
        self.d_mlp = self.adapter.d_mlp(self.hf_model)
        self.n_ctx = self.adapter.n_ctx(self.hf_model)
        self.backend_name = backend
        self.backend = _make_backend(backend, self)
        self.hooks = HookManager(self.backend, self.n_layers, self.d_model,
                                 has_resid_mid=not self.adapter.is_parallel(self.hf_model))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # --- facts -------------------------------------------------------------------
    def __repr__(self):
        return (f"SteerModel({self.name!r}, backend={self.backend_name!r}, n_layers={self.n_layers}, "
                f"d_model={self.d_model}, adapter={self.adapter.name!r})")

    @property
    def device(self) -> torch.device:
        """Where inputs go: the first device holding weights (a model accelerate offloads keeps some
        on the meta device), or where its embedding executes."""
        return _execution_device(self.adapter.embed_module(self.hf_model), self.hf_model)

    def site_device(self, site: str) -> torch.device:
        """The device a site's activations are computed on (the block's, for a model spread over
        devices with a ``device_map``)."""
        s = self.hooks.parse(site)
        if s.layer is None:
            return _execution_device(self.adapter.final_norm_module(self.hf_model), self.hf_model)
        return _execution_device(self.adapter.block(self.hf_model, s.layer), self.hf_model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    def hook_names(self, components: bool = False) -> list[str]:
        """Every hook name: each block's residual and sub-layer hooks and the final norm's; with
        ``components`` also each block's attention, MLP (or mixture-of-experts) and norm hooks this
        family has."""
        if not components:
            return hooknames.all_names(self.n_layers, has_resid_mid=self.hooks.has_resid_mid)
        return hooknames.all_names(self.n_layers, has_resid_mid=self.hooks.has_resid_mid,
                                   components=lambda l: self.adapter.component_hooks(self.hf_model, l))

    def fingerprint(self) -> str:
        """A hash of the config and a few weight tensors, stored in artifacts' provenance. A model that
        :func:`load_model` quantised keeps the fingerprint of the model it was quantised from, so
        artifacts made on the full-precision model apply to it."""
        return self._fingerprint or model_fingerprint(self.hf_model)

    @functools.cached_property
    def facts(self) -> ModelFacts:
        """This model as lowering sees it (:class:`~steerkit.interventions.ModelFacts`), computed once."""
        return ModelFacts.from_hf_config(self.hf_model.config, name=self.name, fingerprint=self.fingerprint(),
                                         adapter=self.adapter, model=self.hf_model)

    # --- tokens ------------------------------------------------------------------
    def format(self, prompt: str, chat: bool = False) -> str:
        """The text the model sees: ``prompt`` as it is (default), or the chat template around it
        (user turn plus generation prompt) when ``chat``.

        Examples:
            >>> tiny.format("hi")
            'hi'
        """
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=False)
        return prompt

    def tokenize(self, prompts: Prompts | Tokens, *, chat: bool = False) -> Tokens:
        """Left-padded token ids of ``prompts``: the raw text by default (with the tokenizer's special
        tokens), the chat template around each prompt when ``chat``. ``Tokens`` pass through."""
        if isinstance(prompts, Tokens):
            return prompts
        check_prompts(prompts)
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InputError("expected at least one prompt, found an empty list")
        if not all(isinstance(p, str) for p in prompts):
            bad = next(p for p in prompts if not isinstance(p, str))
            raise InputError(f"expected prompts as strings, found {type(bad).__name__}: {bad!r}")
        texts = [self.format(p, chat) for p in prompts]
        tok = self.tokenizer
        ids = [tok(t, add_special_tokens=not (chat and getattr(tok, "chat_template", None)))["input_ids"]
               for t in texts]
        return self.pad(ids)

    def pad(self, ids: Sequence[Sequence[int]]) -> Tokens:
        lens = [len(x) for x in ids]
        if min(lens) == 0:
            raise InputError(f"expected every prompt to have at least one token, found an empty one "
                             f"at index {lens.index(0)}")
        if self.n_ctx is not None and max(lens) > self.n_ctx:
            i = lens.index(max(lens))
            raise InputError(f"expected prompts of at most {self.n_ctx} tokens (the model's context), "
                             f"found {max(lens)} tokens in prompt {i}; shorten or split it")
        P = max(lens)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), P), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), P), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, P - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, P - len(x):] = 1
        return Tokens(input_ids.to(self.device), mask.to(self.device))

    # --- running -----------------------------------------------------------------
    def forward(self, prompts: Prompts | Tokens, *, chat: bool = False, grad: bool | None = None,
                logits_to_keep: int = 0) -> Float[Tensor, "batch pos vocab"]:
        """Logits ``[batch, pos, vocab]`` of a left-padded batch: text prompts are tokenized as raw text
        by default (``chat=True``: inside the chat template, as a reply would be generated).
        ``logits_to_keep=k`` (as in transformers) returns only the last ``k`` positions ``[batch, k, vocab]``
        and runs only those through the unembedding (0: every position).

        Runs under ``torch.inference_mode`` unless ``grad`` (by default: inside :meth:`training`):
        then autograd records the pass, so a metric of the logits can be differentiated with respect
        to any tensor an intervention brought in (``Intervention.add(site, v)`` with ``v`` an
        ``nn.Parameter``, or ``Intervention.apply(site, lambda h: h + delta)``), as attribution
        patching and :mod:`steerkit.probes.train` do."""
        if grad is None:
            grad = self.in_training
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise InputError(f"expected logits_to_keep as an int >= 0 (0: every position), found {logits_to_keep!r}")
        toks = self.tokenize(prompts, chat=chat)
        with torch.enable_grad() if grad else torch.inference_mode():
            with self.hooks.runs.running(toks.attention_mask, toks.input_ids):
                return self.backend.forward(toks.input_ids, toks.attention_mask, toks.position_ids,
                                            keep=logits_to_keep)

    __call__ = forward

    @property
    def in_training(self) -> bool:
        """Whether a :meth:`training` scope is open (passes then run with autograd by default).

        Examples:
            >>> tiny.in_training
            False
            >>> with tiny.training():
            ...     print(tiny.in_training)
            True
        """
        return self.__dict__.get("_grad_scopes", 0) > 0

    @contextlib.contextmanager
    def training(self, *, freeze: bool = True) -> Iterator["SteerModel"]:
        """A scope in which :meth:`forward` runs with autograd (``grad=True`` by default) and grad mode
        is on, so steering compiled inside it keeps trainable vectors in the graph; outside it,
        inference mode stays the default. ``freeze`` (default) turns off ``requires_grad`` on the
        model's weights for the scope (no weight gradients are computed or stored) and restores it
        on exit, also after an exception. The model stays in eval mode (no dropout).

        Examples:
            >>> v = torch.nn.Parameter(torch.zeros(tiny.d_model))
            >>> with tiny.training(), tiny.steer(steerkit.Intervention.add("blocks.0.hook_resid_post", v)):
            ...     tiny.forward("hi", chat=False)[0, -1, 0].backward()
            >>> v.grad.shape == v.shape, tiny.forward("hi", chat=False).requires_grad
            (True, False)
        """
        params = [p for p in self.hf_model.parameters() if p.requires_grad] if freeze else []
        for p in params:
            p.requires_grad_(False)
        self.__dict__["_grad_scopes"] = self.__dict__.get("_grad_scopes", 0) + 1
        try:
            with torch.enable_grad():
                yield self
        finally:
            self.__dict__["_grad_scopes"] -= 1
            for p in params:
                p.requires_grad_(True)

    def generate(self, prompts: Prompts | Tokens, max_new_tokens: int = 32, *, chat: bool = False,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: Sequence[str] = (), seed: int | None = None, stream: Callable | None = None,
                 return_tokens: bool = False, steering=None, steer_rows: Sequence | None = None,
                 steer_positions: PositionSpec | None = None, preserve_norm: bool = False, recycle=None):
        """Generate continuations (greedy by default) with the KV cache; returns the new texts. Text
        prompts are continued as raw text by default; ``chat=True`` wraps each in the chat template so
        the model writes a reply.

        ``steering``: anything :meth:`steer` takes, for every row (a list of interventions composes).
        ``steer_rows``: one steering (or ``None``) per prompt, each row steered its own way, with one
        fused call per hooked site per step. ``steer_positions`` replaces the positions of every
        intervention when given. ``recycle``: a :class:`steerkit.generation.Recycle` (representation
        recycling on thinking tokens, Qian et al. 2025). A list of steerings passed as ``steering=``
        (the old per-row form) still works and warns (:class:`DeprecationWarning`).

        Examples:
            >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 4.0)
            >>> both = tiny.generate(["Hi", "Bye"], 3, chat=False, steering=[add, add.at("last")])  # one steering
            >>> rows = tiny.generate(["Hi", "Bye"], 3, chat=False, steer_rows=[[add], None])  # per row
            >>> rows[1] == tiny.generate(["Bye"], 3, chat=False)[0]
            True
        """
        kw = dict(max_new_tokens=max_new_tokens, chat=chat, do_sample=do_sample, temperature=temperature,
                  top_p=top_p, top_k=top_k, stop=stop, seed=seed, stream=stream, return_tokens=return_tokens,
                  recycle=recycle)
        steering, steer_rows = _rows_of(steering, steer_rows, "generate", "steer_rows")
        if steering is None and steer_rows is None:
            return _generate(self, prompts, **kw)  # (it checks its arguments first)
        check_generate_args(self, prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=seed, stop=stop, stream=stream)  # before compiling
        n = 1 if isinstance(prompts, str) else len(prompts)
        if steer_rows is not None and len(steer_rows) != n:
            raise InputError(f"expected one steering spec per prompt ({n}), found {len(steer_rows)}")
        with self.steer(steering, rows=steer_rows, positions=steer_positions, preserve_norm=preserve_norm):
            return _generate(self, prompts, **kw)

    def run_cached(self, prompts: Prompts | Tokens, *, chat: bool = False) -> RunCache:
        """Run ``prompts`` once and keep what :meth:`run_from` starts from: each block's input residual,
        every layer's keys and values and the logits (:func:`steerkit.reuse.run_cached`).

        Examples:
            >>> rc = tiny.run_cached("hello there")
            >>> rc.n_pos, len(rc.resid)
            (2, 4)
        """
        return reuse.run_cached(self, prompts, chat=chat)

    def run_from(self, site: int | str, cache: RunCache, *, start: int = 0, rows: Sequence[int] | None = None,
                 keep: int = 0) -> Float[Tensor, "rows new_pos vocab"]:
        """The logits of positions ``start ..`` of a pass that starts at block ``site`` (an index or a hook
        name in the block) from ``cache`` (:meth:`run_cached`): blocks below it are not run, and attention
        reads the cached keys and values before ``start``. Edits in force must act at that block or later
        and at ``start`` or later; then the logits equal a full pass's (see :mod:`steerkit.reuse`).

        Examples:
            >>> rc = tiny.run_cached("When Mary and John went")
            >>> edit = steerkit.Intervention.add("blocks.1.hook_resid_pre", torch.ones(64), positions=[-1])
            >>> with tiny.steer(edit):
            ...     last = tiny.run_from("blocks.1.hook_resid_pre", rc, start=rc.n_pos - 1)
            ...     full = tiny.forward("When Mary and John went")
            >>> torch.allclose(last[:, -1], full[:, -1], atol=1e-5)
            True
        """
        return reuse.run_from(self, site, cache, start=start, rows=rows, keep=keep)  # type: ignore[return-value]

    # --- hooks -------------------------------------------------------------------
    def record(self, hooks: str | Iterable[str], positions: PositionSpec = "all", *,
               device=None, heads=None, neurons=None) -> RecordHandle:
        """Record ``hooks`` at ``positions`` during every forward/generate until the handle is removed:
        ``with sm.record(hooks) as cache: ...`` (or ``h = sm.record(...)``, ``h.cache``, ``h.remove()``).
        ``heads=[...]`` / ``neurons=[...]`` keep only those heads or neurons (``cache[hook]`` is then
        ``[batch, pos, len(heads), d_head]``, ``[batch, len(heads), q_pos, k_pos]`` or
        ``[batch, pos, len(neurons)]``)."""
        return self.hooks.record(hooks, positions, device=device, heads=heads, neurons=neurons)

    def attach_sae(self, sae, site: str | None = None, *, splice: bool = False, keep_error: bool = False,
                   positions: PositionSpec = "all", override: bool = False) -> SAEHandle:
        """Attach a sparse autoencoder at its site (``sae``: ``steerkit.load_sae(...)``, whose own site is used,
        or a :class:`steerkit.sae.SAEWeights` with ``site=``) until the handle is removed (``with``). While
        attached, the site's sub-sites ``{site}.hook_sae_input`` / ``hook_sae_acts_post`` / ``hook_sae_recons``
        / ``hook_sae_error`` (sae-lens's names) can be recorded like any site (:mod:`steerkit.saesites`).
        ``splice=True`` also runs the model with the reconstruction in place of the activation at
        ``positions`` (``keep_error=True``: plus the error term), an edit installed through :meth:`steer`.
        A stored SAE is checked against this model first (its widths always; depth and fingerprint unless
        ``override``); the SAE's tensors move to the site's device.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> g = torch.Generator().manual_seed(0)
            >>> w = SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
            ...                torch.randn(128, 64, generator=g) / 8, torch.zeros(64), architecture="topk", k=8)
            >>> acts = "blocks.1.hook_resid_post.hook_sae_acts_post"
            >>> with tiny.attach_sae(w, "blocks.1.hook_resid_post"), tiny.record(acts) as cache:
            ...     _ = tiny.forward(["The quick brown fox", "hi"], chat=False)
            >>> tuple(cache[acts].shape), (cache[acts][0] != 0).sum(-1).tolist()  # 8 latents on each token
            ((2, 4, 128), [8, 8, 8, 8])
            >>> with tiny.attach_sae(w, "blocks.1.hook_resid_post", splice=True):  # the reconstruction runs on
            ...     spliced = tiny.forward("hello world", chat=False)
        """
        if not splice and (keep_error or not (isinstance(positions, str) and positions == "all")):
            raise InputError("expected keep_error= and positions= only with splice=True (they say how the "
                             "reconstruction replaces the activation), found them without")
        weights, site = saesites.sae_parts(sae, site)
        if splice and weights.transcoder:
            raise InputError("expected an autoencoder to splice in (its reconstruction replaces the site it reads), "
                             "found a transcoder, which predicts another site; steer its latents with "
                             "Transcoders.clamp, or attach it without splice= to record them")
        s = self.hooks.parse(site)
        width = self.facts.width(s.kind, site) if s.kind in hooknames.SAE_HOST_HOOKS else None
        if width is not None and width != weights.d_in:
            raise InputError(f"expected an SAE at {site} to read {width} features on {self.name!r}, found d_in="
                             f"{weights.d_in}; it was made for another model or another site")
        check = getattr(sae, "check", None)
        if sae is not weights and callable(check):
            check(self, override=override)
        dev = self.site_device(site)
        if weights.device != dev:
            weights = weights.to(device=dev)
        h = saesites.attach(self.hooks, weights, s)
        if splice:
            try:
                h.splice = self.steer(saesites.splice_intervention(weights, site, keep_error=keep_error,
                                                                   positions=positions),
                                      label=f"splice sae at {site}")
            except BaseException:
                h.remove()
                raise
            h.keep_error = keep_error
            h._removers.append(h.splice.remove)  # removed first (removers run in reverse)
        return h

    def attach_transcoders(self, transcoders, layers=None, *, override: bool = False) -> saesites.TranscodersHandle:
        """Attach the transcoders of ``layers`` (default: every block; an index, a list or a spec such as
        ``"0-3"``) of a :class:`steerkit.vectors.Transcoders` set at their input sites until the handle is removed
        (``with``). While attached, block ``l``'s latents are recordable sub-sites of ``blocks.{l}.mlp.hook_in``,
        sae-lens's names: ``.hook_sae_acts_pre``, ``.hook_sae_acts_post`` and its prediction ``.hook_sae_output``
        (:mod:`steerkit.saesites`; equal to ``transcoders.encode_layer(input, l)``). The set is checked against this
        model first (its widths and depth always; its fingerprint unless ``override``). A cross-layer transcoder is
        refused (a block's prediction sums the features of every block up to it).

        Examples:
            >>> from steerkit.vectors import Provenance, Transcoders
            >>> g = torch.Generator().manual_seed(0)
            >>> L, d = tiny.n_layers, tiny.d_model
            >>> tc = Transcoders([torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(32)] * L,
            ...                  [torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
            ...                  activation="topk", k=4, provenance=Provenance.from_model(tiny))
            >>> acts = "blocks.1.mlp.hook_in.hook_sae_acts_post"
            >>> with tiny.attach_transcoders(tc), tiny.record(acts) as cache:
            ...     _ = tiny.forward("hello world", chat=False)
            >>> (cache[acts][0] != 0).sum(-1).tolist()  # 4 features on each token
            [4, 4]
        """
        layer_weights, sites = getattr(transcoders, "layer_weights", None), getattr(transcoders, "sites", None)
        if not callable(layer_weights) or not callable(sites):
            raise InputError(f"expected a steerkit.vectors.Transcoders (steerkit.load_transcoders(...)), found "
                             f"{type(transcoders).__name__}; attach one transcoder SAE with sm.attach_sae")
        if getattr(transcoders, "cross_layer", False):
            raise InputError("expected a per-layer transcoder set to attach, found a cross-layer transcoder (a block's "
                             "prediction sums the features of every block up to it); record the input sites and "
                             "encode them with transcoders.encode_layer")
        transcoders.check(self, override=override)
        chosen = list(range(self.n_layers)) if layers is None else hooknames.parse_layers(layers, self.n_layers)
        handles: dict = {}
        try:
            for layer in chosen:
                handles[layer] = self.attach_sae(layer_weights(layer), sites(layer)[0])
        except BaseException:
            for h in handles.values():
                h.remove()
            raise
        return saesites.TranscodersHandle.of(self.hooks, handles, f"transcoders at blocks {chosen}")

    def edit(self, hooks: str | Iterable[str] | dict | None = None, *, add=None, ablate=None, replace=None,
             clamp=None, value: float = 0.0, fn: Callable | None = None, scale: float = 1.0,
             positions: PositionSpec = "all", op: str | None = None, heads=None, neurons=None) -> HookHandle:
        """Edit activations at ``hooks``; returns a handle (use it with ``with``, or call ``.remove()``).

        Exactly one of ``add`` (vector ``[d_model]``), ``ablate`` (``[d_model]`` or an orthonormal
        ``[k, d_model]``; ``scale`` is its strength), ``replace``, ``clamp`` (direction; its projection
        becomes ``value``) or ``fn`` (callable on ``[batch, pos, d_model]``). ``hooks`` may also be a dict
        ``{hook_name: tensor}`` for one operation ``op=`` with a different tensor per hook. Each becomes
        an :class:`~steerkit.interventions.Intervention` (see :meth:`steer`). ``heads=[...]`` (attention
        component hooks) / ``neurons=[...]`` (MLP hooks) limit it to those, with ``d_head`` /
        ``len(neurons)``-wide vectors: ``sm.edit("blocks.5.attn.hook_z", replace=torch.zeros(64), heads=[3])``
        zero-ablates head 3 of block 5.
        """
        ops = {k: v for k, v in dict(add=add, ablate=ablate, replace=replace, clamp=clamp, fn=fn).items()
               if v is not None}
        if isinstance(hooks, dict):
            if ops:
                raise InputError("with a {hook_name: tensor} dict, name the operation with op='add'|'ablate'|"
                                 "'replace'|'clamp'|'fn' and pass no tensor keyword")
            per_hook, op = hooks, op or "add"
        else:
            if len(ops) != 1:
                raise InputError(f"expected exactly one of add=, ablate=, replace=, clamp=, fn=, found "
                                 f"{sorted(ops) or 'none'}")
            if hooks is None:
                raise InputError("expected hook names to edit, found None; e.g. 'blocks.15.hook_resid_post'")
            op, t = next(iter(ops.items()))
            per_hook = {n: t for n in self.hooks._names(hooks)}
        if op not in EDIT_OPS:
            raise InputError(f"expected an edit operation in {tuple(EDIT_OPS)}, found {op!r}")
        return self.steer([EDIT_OPS[op](h, t, scale, value, positions, heads=heads, neurons=neurons)
                           for h, t in per_hook.items()],
                          label=f"{op} {list(per_hook)}")

    def steer(self, steering=None, scale: float = 1.0, *, rows: Sequence | None = None,
              positions: PositionSpec | None = None, preserve_norm: bool = False, override: bool = False,
              label: str | None = None) -> HookHandle:
        """Apply a steering until the handle is removed (``with sm.steer(...):`` or ``.remove()``).

        ``steering``, the same for every row: an :class:`~steerkit.interventions.Intervention` or a
        list of them (composed: all apply); a :class:`~steerkit.interventions.Steerable` (every stored
        artifact kind: checked against this model's d_model, depth and fingerprint unless ``override``;
        ``scale`` multiplies it); a ``{hook: SteerConfig}`` dict of the kernel's configurations still works
        and warns (deprecated). ``rows``: instead, one of those (or ``None``)
        per batch row, which steers each row its own way in the same kernel call. Everything is lowered
        to interventions and compiled once here (:func:`steerkit.interventions.compile_steering`); ``positions``
        replaces every intervention's own. A list of steerings passed as ``steering`` (the old per-row
        form) still works and warns (:class:`DeprecationWarning`): pass ``rows=``.

        Examples:
            >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 4.0)
            >>> with tiny.steer([add, add.at("last")]):  # one steering for every row: both apply
            ...     both = tiny.forward(["hi", "bye"], chat=False)
            >>> with tiny.steer(rows=[[add], None]):  # row 0 steered, row 1 not
            ...     per_row = tiny.forward(["hi", "bye"], chat=False)
            >>> torch.allclose(per_row[1], tiny.forward(["hi", "bye"], chat=False)[1])
            True
        """
        steering, rows = _rows_of(steering, rows, "steer")
        compiled = self.compile(steering, scale, rows=rows, positions=positions, preserve_norm=preserve_norm,
                                override=override)
        return self.hooks.install(compiled, label=label or f"steer {list(compiled.programs)}"
                                  + (f" per-row x{compiled.n_groups}" if compiled.n_groups > 1 else ""))

    def compile(self, steering=None, scale: float = 1.0, *, rows: Sequence | None = None,
                positions: PositionSpec | None = None, preserve_norm: bool = False,
                override: bool = False) -> CompiledSteering:
        """:meth:`steer`'s lowering and compilation, without registering anything.

        Examples:
            >>> add = steerkit.Intervention.add("blocks.1.hook_resid_post", torch.ones(64))
            >>> tiny.compile(add).n_groups, tiny.compile(rows=[[add], None, add]).n_groups
            (1, 3)
        """
        steering, rows = _rows_of(steering, rows, "compile")
        if steering is None and rows is None:
            raise InputError("expected a steering (interventions or a steerable artifact) or "
                             "rows= (one per batch row), found None")
        facts = self.facts
        groups: list
        if rows is not None:
            groups = [None if s is None else lower(s, facts, scale=scale, override=override) for s in rows]
        else:
            groups = [lower(steering, facts, scale=scale, override=override)]
        if preserve_norm:
            groups = [None if g is None else [dataclasses.replace(p, preserve_norm=True) if p.op in KERNEL_OPS
                                              else p for p in g] for g in groups]
        spread = len({str(d) for d in getattr(self.hf_model, "hf_device_map", {}).values()} - {"disk", "cpu"}) > 1
        return compile_steering(groups, facts, per_row=True, device=self.site_device if spread else self.device,
                       dtype=self.dtype, positions=positions)

    def reset(self) -> None:
        """Remove every hook steerkit registered on this model."""
        self.hooks.reset()

    def hook_count(self) -> int:
        return self.backend.hook_count()


def _execution_device(module: torch.nn.Module, model: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: its accelerate hook's execution device when it has one, else the device
    of its first weight not on the meta device, else the model's, else the CPU."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for m in (module, model):
        for p in m.parameters():
            if p.device.type != "meta":
                return p.device
    return torch.device("cpu")


def _make_backend(name: str, sm: SteerModel):
    if name == "hf":
        return HFBackend(sm.model, sm.adapter)
    if name == "tlens":
        return TLensBackend(sm)
    if name == "nnsight":
        return NNsightBackend(sm)
    raise InputError(f"expected backend in {BACKENDS}, found {name!r}")


def load_model(name_or_path=None, *, backend: str = "hf", dtype: torch.dtype | str = "auto",
               device: str | torch.device = "auto", quantize: str | None = None, device_map=None,
               max_memory: dict | None = None, offload_folder=None, revision: str | None = None,
               token: str | bool | None = None, local_files_only: bool | None = None) -> SteerModel:
    """Load a model and wrap it: ``None`` is the embedded SmolLM2-135M-Instruct.

    ``name_or_path``: a ``.gguf`` file, a Hugging Face model folder, or a Hub id such as
    ``"Qwen/Qwen2.5-1.5B-Instruct"``, downloaded by ``huggingface_hub`` into its cache the first time
    (``revision``: a branch, tag or commit; ``token``: for private and gated models, else ``HF_TOKEN`` or
    ``hf auth login``). ``local_files_only=True``, or ``HF_HUB_OFFLINE=1``, reads the cache only.
    ``device``: ``"auto"`` (CUDA, then MPS, then the CPU) or any torch device; ``dtype``: ``"auto"``
    (bfloat16 on a CUDA device that supports it, float32 elsewhere) or a floating-point dtype or its
    name (:mod:`steerkit.loading.device`). ``backend``: ``"hf"`` (PyTorch hooks), ``"tlens"``
    (TransformerLens 4 ``TransformerBridge``) or ``"nnsight"``. ``quantize``: ``"int8"`` or ``"int4"``
    weight-only quantisation of the decoder blocks' linear layers (:mod:`steerkit.loading.quantize`,
    torchao); the model keeps the fingerprint of its full-precision weights. ``device_map`` (``"auto"``
    or a dict), ``max_memory`` (``{"cpu": "2GiB", 0: "20GiB"}``) and ``offload_folder``: accelerate's
    big-model loading, for a model larger than memory (layers that do not fit are kept on disk and
    loaded for each forward pass) or spread over several devices; hooks and steering tables follow each
    block's device.

    Examples:
        >>> from steerkit.loading.export_hf import export_hf
        >>> folder = export_hf(tiny, tmp_dir / "tiny")       # a Hugging Face model folder
        >>> m = steerkit.load_model(folder)
        >>> m.n_layers, m.d_model, m.fingerprint() == tiny.fingerprint(), m.dtype, m.device.type
        (4, 64, True, torch.float32, 'cpu')

        ``steerkit.load_model()`` with no argument is the embedded default model (``sm`` in these examples).
    """
    if backend not in BACKENDS:
        raise InputError(f"expected backend in {BACKENDS}, found {backend!r}")
    dev = pick_device(device) if device_map is None else None
    dt = pick_dtype(dtype, dev if dev is not None else "cpu")
    if quantize is not None and quantize not in SCHEMES:
        raise InputError(f"expected quantize= one of {SCHEMES} (or None), found {quantize!r}")
    name, folder, gguf = resolve(name_or_path)
    model, tok = load_hf(folder, dtype=dt, device=dev or "cpu", device_map=device_map, max_memory=max_memory,
                         offload_folder=offload_folder, revision=revision, token=token,
                         local_files_only=local_files_only)
    fingerprint = None
    if quantize is not None:
        fingerprint = model_fingerprint(model)
        quantize_weights(model, quantize, adapter_for(model).block_list(model))
    return wrap(model, tok, name=name, backend=backend, source_gguf=gguf, fingerprint=fingerprint)


def wrap(model, tokenizer, *, name: str | None = None, backend: str = "hf", source_gguf=None,
         fingerprint: str | None = None) -> SteerModel:
    """Wrap an already loaded HF causal LM and tokenizer (``fingerprint``: the provenance fingerprint
    to use instead of the weights', e.g. of the model a quantised one was made from).

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=len(tiny.tokenizer), hidden_size=32, intermediate_size=64,
        ...                   num_hidden_layers=2, num_attention_heads=2)
        >>> steerkit.wrap(LlamaForCausalLM(cfg).eval(), tiny.tokenizer, name="two-layer")
        SteerModel('two-layer', backend='hf', n_layers=2, d_model=32, adapter='llama')
    """
    name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
    return SteerModel(model, tokenizer, name=name, backend=backend, source_gguf=source_gguf, fingerprint=fingerprint)
