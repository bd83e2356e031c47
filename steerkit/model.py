"""``SteerModel``: a causal LM, its tokenizer, its adapter, a backend and a hook manager.

``load_model`` resolves the model offline (see :mod:`steerkit.loading`), picks
the adapter for its architecture, and wraps the chosen backend. Every forward
pass and generation step runs through the backend under a
:class:`~steerkit.positions.RunState`, so hooks know which positions are real
prompt tokens, padding, or generated tokens. Prompts are left-padded and
position ids come from the attention mask, so a padded row computes exactly
what it computes alone.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from . import hooknames
from .adapters import Adapter, adapter_for
from .edits import Edit
from .errors import InputError
from .hooks import ActivationCache, HookHandle, HookManager
from .positions import PositionSpec

Prompts = Union[str, Sequence[str]]


class Tokens:
    """A tokenized, left-padded batch: ``input_ids`` and ``attention_mask`` ``[batch, pos]``."""

    def __init__(self, input_ids: Tensor, attention_mask: Tensor):
        self.input_ids = input_ids
        self.attention_mask = attention_mask

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def __len__(self):
        return int(self.input_ids.shape[0])


class SteerModel:
    """A model ready to be recorded and steered. Build it with :func:`steerkit.load_model`."""

    def __init__(self, model, tokenizer, *, name: str, backend: str = "hf", adapter: Adapter | None = None,
                 source_gguf=None, hf_model=None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.source_gguf = source_gguf
        self.hf_model = hf_model if hf_model is not None else model
        self.adapter = adapter or adapter_for(self.hf_model)
        self.n_layers = self.adapter.n_layers(self.hf_model)
        self.d_model = self.adapter.d_model(self.hf_model)
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
        return next(self.hf_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    def hook_names(self) -> list[str]:
        return hooknames.all_names(self.n_layers, has_resid_mid=self.hooks.has_resid_mid)

    def fingerprint(self) -> str:
        """A hash of the config and a few weight tensors, stored in artifacts' provenance."""
        from .fingerprint import model_fingerprint
        return model_fingerprint(self.hf_model)

    # --- tokens ------------------------------------------------------------------
    def format(self, prompt: str, chat: bool = True) -> str:
        """The text the model sees: the chat template around ``prompt`` when ``chat``."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=False)
        return prompt

    def tokenize(self, prompts: Prompts, *, chat: bool = True) -> Tokens:
        """Left-padded token ids of ``prompts`` (with the chat template when ``chat``)."""
        if isinstance(prompts, Tokens):
            return prompts
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
    @torch.inference_mode()
    def forward(self, prompts: Prompts | Tokens, *, chat: bool = True) -> Float[Tensor, "batch pos vocab"]:
        """Logits ``[batch, pos, vocab]`` of a left-padded batch (chat template by default)."""
        toks = self.tokenize(prompts, chat=chat)
        with self.hooks.runs.running(toks.attention_mask, toks.input_ids):
            return self.backend.forward(toks.input_ids, toks.attention_mask, toks.position_ids)

    __call__ = forward

    def generate(self, prompts: Prompts | Tokens, max_new_tokens: int = 32, *, chat: bool = True,
                 do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: Sequence[str] = (), seed: int | None = None, stream: Callable | None = None,
                 return_tokens: bool = False, steering=None, steer_positions: PositionSpec = "all",
                 preserve_norm: bool = False, recycle=None):
        """Generate continuations (greedy by default) with the KV cache; returns the new texts.

        ``steering``: ``{hook: SteerConfig}`` for every row, or a list with one per prompt
        (``None`` for an unsteered row); applied with one fused call per hooked layer per step.
        ``recycle``: a :class:`steerkit.generation.Recycle` (representation recycling on thinking
        tokens, Qian et al. 2025).
        """
        from .generation import generate
        kw = dict(max_new_tokens=max_new_tokens, chat=chat, do_sample=do_sample, temperature=temperature,
                  top_p=top_p, top_k=top_k, stop=stop, seed=seed, stream=stream, return_tokens=return_tokens,
                  recycle=recycle)
        if steering is None:
            return generate(self, prompts, **kw)
        n = 1 if isinstance(prompts, str) else len(prompts)
        if isinstance(steering, (list, tuple)) and len(steering) != n:
            raise InputError(f"expected one steering spec per prompt ({n}), found {len(steering)}")
        with self.steer(steering, positions=steer_positions, preserve_norm=preserve_norm):
            return generate(self, prompts, **kw)

    # --- hooks -------------------------------------------------------------------
    @contextlib.contextmanager
    def record(self, hooks: str | Iterable[str], positions: PositionSpec = "all", *,
               device=None) -> Iterator[ActivationCache]:
        """Record ``hooks`` at ``positions`` during every forward/generate inside the scope."""
        handle, cache = self.hooks.record(hooks, positions, device=device)
        try:
            yield cache
        finally:
            handle.remove()

    def edit(self, hooks: str | Iterable[str] | dict | None = None, *, add=None, ablate=None, replace=None,
             clamp=None, value: float = 0.0, fn: Callable | None = None, scale: float = 1.0,
             positions: PositionSpec = "all", op: str | None = None) -> HookHandle:
        """Edit activations at ``hooks``; returns a handle (use it with ``with``, or call ``.remove()``).

        Exactly one of ``add`` (vector ``[d_model]``), ``ablate`` (``[d_model]`` or an orthonormal
        ``[k, d_model]``), ``replace``, ``clamp`` (direction; its projection becomes ``value``) or
        ``fn`` (callable on ``[batch, pos, d_model]``). ``hooks`` may also be a dict
        ``{hook_name: vector}`` for one operation with a different vector per hook.
        """
        ops = {k: v for k, v in dict(add=add, ablate=ablate, replace=replace, clamp=clamp, fn=fn).items()
               if v is not None}
        if isinstance(hooks, dict):
            if ops:
                raise InputError("with a {hook_name: tensor} dict, name the operation with op='add'|'ablate'|"
                                 "'replace'|'clamp'|'fn' and pass no tensor keyword")
            return self.edit_op(op or "add", hooks, scale=scale, value=value, positions=positions)
        if len(ops) != 1:
            raise InputError(f"expected exactly one of add=, ablate=, replace=, clamp=, fn=, found "
                             f"{sorted(ops) or 'none'}")
        op, t = next(iter(ops.items()))
        if hooks is None:
            raise InputError("expected hook names to edit, found None; e.g. 'blocks.15.hook_resid_post'")
        names = self.hooks._names(hooks)
        return self.edit_op(op, {n: t for n in names}, scale=scale, value=value, positions=positions)

    def edit_op(self, op: str, per_hook: dict, *, scale: float = 1.0, value: float = 0.0,
                positions: PositionSpec = "all") -> HookHandle:
        """One operation with its own tensor (or callable) per hook name."""
        edits = {}
        for name, t in per_hook.items():
            self.hooks.parse(name)
            if op == "fn":
                edits[name] = Edit.make("fn", fn=t, d_model=self.d_model, scale=scale, positions=positions)
            else:
                edits[name] = Edit.make(op, t, d_model=self.d_model, scale=scale, value=value,
                                        positions=positions)
        return self.hooks.edit(edits, label=f"{op} {list(per_hook)}")

    def steer(self, steering, scale: float = 1.0, *, positions: PositionSpec = "all", preserve_norm: bool = False,
              override: bool = False):
        """Apply steering inside a ``with`` block.

        ``steering`` is either a stored artifact (``steerkit.vectors.SteeringVector`` /
        ``DirectionSet``: checked against this model's d_model, n_layers and fingerprint unless
        ``override``; ``scale`` multiplies it), or ``{hook: SteerConfig}`` / a list of them, one per
        batch row, applied by the fused kernel (see ``steerkit.steering``).
        """
        if isinstance(steering, (dict, list, tuple)):
            from .steering import steer
            if scale != 1.0:
                raise InputError("scale= applies to artifacts; put the scale in each SteerConfig")
            return steer(self, steering, positions=positions, preserve_norm=preserve_norm)
        from steerkit.vectors.apply import steer as steer_artifact
        return steer_artifact(self, steering, scale, override=override)

    def reset(self) -> None:
        """Remove every hook steerkit registered on this model."""
        self.hooks.reset()

    def hook_count(self) -> int:
        return self.backend.hook_count()


def _make_backend(name: str, sm: SteerModel):
    from .backends import BACKENDS
    if name == "hf":
        from .backends.hf import HFBackend
        return HFBackend(sm.model, sm.adapter)
    if name == "tlens":
        from .backends.tlens import TLensBackend
        return TLensBackend(sm)
    if name == "nnsight":
        from .backends.nnsight import NNsightBackend
        return NNsightBackend(sm)
    raise InputError(f"expected backend in {BACKENDS}, found {name!r}")


def load_model(name_or_path=None, *, backend: str = "hf", dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu") -> SteerModel:
    """Load a model offline and wrap it: ``None`` is the embedded SmolLM2-135M-Instruct.

    ``name_or_path``: a ``.gguf`` file, a Hugging Face model folder, or a hub id already in the
    local HF cache. ``backend``: ``"hf"`` (PyTorch hooks), ``"tlens"`` (TransformerLens 4
    ``TransformerBridge``) or ``"nnsight"``.
    """
    from . import loading
    from .backends import BACKENDS

    if backend not in BACKENDS:
        raise InputError(f"expected backend in {BACKENDS}, found {backend!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    name, folder, gguf = loading.resolve(name_or_path)
    model, tok = loading.load_hf(folder, dtype=dtype, device=device)
    return wrap(model, tok, name=name, backend=backend, source_gguf=gguf)


def wrap(model, tokenizer, *, name: str | None = None, backend: str = "hf", source_gguf=None) -> SteerModel:
    """Wrap an already loaded HF causal LM and tokenizer."""
    name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
    return SteerModel(model, tokenizer, name=name, backend=backend, source_gguf=source_gguf)
