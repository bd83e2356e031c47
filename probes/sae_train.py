"""Training a TopK sparse autoencoder on a loaded model with EleutherAI's sparsify (the ``sae`` extra).

How it works
------------
:func:`train_sae` drives sparsify's own ``Trainer`` (``TrainConfig`` / ``SparseCoderConfig``: TopK, FVU loss,
its signum optimizer by default) on the Hugging Face model steerkit loaded; steerkit trains nothing itself.

* **Site.** ``blocks.{l}.hook_resid_post`` is the output of decoder layer ``l``: sparsify's hookpoint
  ``layers.{l}`` (a forward hook on the layer). Other sites are refused (:func:`sae_layer`).
* **Only up to the layer.** For the run, the decoder's layer list holds layers ``0..l`` and the model passed
  to sparsify is the base model (no LM head): a forward pass costs ``l + 1`` layers, not all of them plus the
  unembedding (:func:`truncated`). The layer list, ``use_cache``, the weights' ``requires_grad`` (sparsify
  freezes them) and torch's float32 matmul precision (sparsify sets it) are restored afterwards, also after
  an exception.
* **Data.** The corpus (:mod:`.sae_corpus`; the vendored one by default) is tokenized into rows of ``ctx_len``
  tokens that start with the separator token, which sparsify skips (``exclude_tokens``): the first position
  of a row carries the attention sink's outsized activations. ``tokens`` counted tokens (not separators) are
  trained on, rounded up to whole rows; other rows are held out for the metrics.
* **sparsify's settings.** Weights & Biases off; checkpoints only at the end, and the optimizer state kept
  for resuming is removed (steerkit does not resume); the dead-latent horizon (``dead_feature_threshold``)
  is :data:`DEAD_WINDOW`; ``lr_warmup_steps`` (used by the ``adam`` and ``muon`` optimizers) is a tenth of the
  run; on a machine without CUDA, ``SPARSIFY_DISABLE_TRITON=1`` when sparsify is imported (its eager sparse
  decoder). sparsify's messages go to ``sparsify.log`` in the output folder and its progress bar is shown
  in tokens.
* **Output.** sparsify's folder layout: ``OUT/layers.{l}/`` (``cfg.json`` + ``sae.safetensors``, loaded by
  :func:`steerkit.vectors.load_sae`, sae-lens and sparsify) with ``metrics.json`` beside the weights, and
  ``OUT/config.json`` (sparsify's training config) and ``OUT/sparsify.log``.
* **Metrics** (:mod:`.sae_metrics`), on held-out rows: L0, explained variance, the CE losses and the CE loss
  recovered; dead latents from sparsify's own count of tokens since each latent last fired (never active
  over the last :data:`DEAD_WINDOW` training tokens, or over the whole run when it is shorter).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

from steerkit.errors import BackendUnavailableError, HookNameError, InputError
from steerkit.hooks.names import parse
from steerkit.model import SteerModel
from steerkit.vectors import SAE, load_sae

from .sae_corpus import DEFAULT_CORPUS, CorpusChunks, read_corpus, split_chunks, token_chunks
from .sae_metrics import dead_latents, reconstruction_metrics

__all__ = ["SAETrainResult", "train_sae", "sae_layer", "truncated", "DEAD_WINDOW", "OPTIMIZERS"]

#: the horizon of "dead": a latent is dead when it fired on none of the last this many training tokens
DEAD_WINDOW = 1_000_000
#: sparsify's optimizers
OPTIMIZERS = ("signum", "adam", "muon")
_SITE = "hook_resid_post"
_RESUME_FILES = ("optimizer_*.pt", "lr_scheduler_*.pt", "state.pt", "rank_*_state.pt")


@dataclasses.dataclass
class SAETrainResult:
    """A trained SAE: :attr:`sae` (the :class:`steerkit.vectors.SAE` read back from :attr:`folder`, sparsify's
    folder for it), the ``hook`` it reads, the training ``tokens`` and ``seconds``, and the :attr:`metrics` also
    written to ``folder / "metrics.json"``.

    Examples:
        >>> r = train_sae(tiny, "blocks.1.hook_resid_post", tokens=600, k=4, expansion=2, ctx_len=32, batch_size=4,
        ...               eval_tokens=62, out=tmp_dir / "sae", progress=False)
        >>> r.folder.name, r.sae.site, r.sae.d_sae, r.tokens >= 600
        ('layers.1', 'blocks.1.hook_resid_post', 128, True)
        >>> sorted(r.to_json()["metrics"])[:4]
        ['batch_size', 'ce_loss_clean', 'ce_loss_recovered', 'ce_loss_spliced']
    """

    sae: SAE
    folder: Path
    hook: str
    tokens: int
    seconds: float
    metrics: dict

    def to_json(self) -> dict:
        return {"folder": str(self.folder), "hook": self.hook, "tokens": self.tokens, "seconds": self.seconds,
                "metrics": self.metrics}


def sae_layer(sm: SteerModel, hook: str) -> int:
    """The decoder layer whose output ``hook`` is (``blocks.{l}.hook_resid_post``); an
    :class:`~steerkit.errors.InputError` naming the sites an SAE can be trained at for any other name.

    Examples:
        >>> sae_layer(tiny, "blocks.2.hook_resid_post")
        2
        >>> sae_layer(tiny, "blocks.2.hook_resid_pre")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected an SAE site blocks.L.hook_resid_post with L in 0..3 ...
    """
    try:
        site = parse(hook, sm.n_layers) if isinstance(hook, str) else None
    except HookNameError:
        site = None
    if site is None or site.kind != _SITE or site.layer is None:
        raise InputError(f"expected an SAE site blocks.L.{_SITE} with L in 0..{sm.n_layers - 1} (the output of "
                         f"decoder layer L, sparsify's layers.L), found {hook!r:.120}; train at a residual "
                         "stream output such as blocks.12.hook_resid_post")
    return site.layer


def _layers_path(base: nn.Module, blocks: nn.ModuleList) -> str:
    for name, module in base.named_modules():
        if module is blocks:
            return name
    raise InputError(f"expected the decoder's layer list inside the base model {type(base).__name__}, found it "
                     "elsewhere; this architecture cannot be trained on up to a layer")


@contextlib.contextmanager
def truncated(sm: SteerModel, layer: int) -> Iterator[tuple[nn.Module, str]]:
    """``(base model, hookpoint)``: ``sm``'s base model (no LM head) running only layers ``0..layer``, and the
    name of layer ``layer`` inside it (``"layers.12"``); everything is restored on exit (see the module
    docstring).

    Examples:
        >>> with truncated(tiny, 1) as (base, hookpoint):
        ...     print(hookpoint, len(base.layers))
        layers.1 2
        >>> len(tiny.hf_model.base_model.layers), next(tiny.hf_model.parameters()).requires_grad
        (4, True)
    """
    base = sm.hf_model.base_model
    blocks = sm.adapter.block_list(sm.hf_model)
    path = _layers_path(base, blocks)
    parent_path, _, attr = path.rpartition(".")
    parent = base.get_submodule(parent_path) if parent_path else base
    grads = [(p, p.requires_grad) for p in base.parameters()]
    use_cache = getattr(base.config, "use_cache", None)
    precision = torch.get_float32_matmul_precision()
    setattr(parent, attr, nn.ModuleList(list(blocks)[: layer + 1]))
    base.config.use_cache = False
    try:
        yield base, f"{path}.{layer}"
    finally:
        setattr(parent, attr, blocks)
        base.config.use_cache = use_cache
        for p, g in grads:
            p.requires_grad_(g)
        torch.set_float32_matmul_precision(precision)


class _Rows(Dataset):
    """Token rows as sparsify's data loader reads them (``{"input_ids": row}``)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}

    def select(self, indices: range) -> "_Rows":
        """The rows at ``indices`` (what a resumed sparsify run reads: the rows not yet trained on)."""
        return _Rows(self.ids[list(indices)])


class _TokenBar:
    """Stands in for sparsify's progress bar (one ``update()`` per batch): advances a bar in tokens."""

    def __init__(self, bar: tqdm, per_batch: Sequence[int]):
        self.bar, self.per_batch = bar, iter(per_batch)

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            self.bar.update(next(self.per_batch, 0))

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _sparsify(device: torch.device, log: io.TextIOBase, bar: _TokenBar) -> Iterator[Any]:
    """sparsify imported (its eager decoder where there is no CUDA), its messages in ``log`` and its progress
    bar ``bar``, for the ``with`` block."""
    cuda = device.type == "cuda"
    before = os.environ.get("SPARSIFY_DISABLE_TRITON")
    with contextlib.redirect_stdout(log):
        try:
            if not cuda:
                os.environ["SPARSIFY_DISABLE_TRITON"] = "1"  # read once, when sparsify.utils is imported
            import sparsify
            import sparsify.sparse_coder
            import sparsify.trainer
            import sparsify.utils
        except ImportError as e:
            raise BackendUnavailableError(f"expected eai-sparsify in this Python environment to train an SAE, found "
                                          f"it missing ({e}); install the 'sae' extra: pip install 'steerkit[sae]'"
                                          ) from None
        finally:
            if before is None:
                os.environ.pop("SPARSIFY_DISABLE_TRITON", None)
            else:
                os.environ["SPARSIFY_DISABLE_TRITON"] = before
        decoder, progress = sparsify.sparse_coder.decoder_impl, sparsify.trainer.tqdm
        if not cuda:  # imported earlier with Triton: its kernels need CUDA
            sparsify.sparse_coder.decoder_impl = sparsify.utils.eager_decode
        sparsify.trainer.tqdm = lambda *args, **kwargs: bar
        try:
            yield sparsify
        finally:
            sparsify.sparse_coder.decoder_impl, sparsify.trainer.tqdm = decoder, progress


def _check_args(sm: SteerModel, tokens: int, k: int, expansion: int, ctx_len: int, batch_size: int,
                eval_tokens: int, optimizer: str, lr: float | None) -> None:
    for name, value, low in (("tokens", tokens, 1), ("k", k, 1), ("expansion", expansion, 1), ("ctx_len", ctx_len, 2),
                             ("batch_size", batch_size, 1), ("eval_tokens", eval_tokens, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"expected {name} as an int >= {low}, found {value!r}")
    if k > sm.d_model * expansion:
        raise InputError(f"expected k at most the number of latents (d_model {sm.d_model} x expansion {expansion} = "
                         f"{sm.d_model * expansion}), found k={k}; lower k or raise expansion")
    if sm.n_ctx is not None and ctx_len > sm.n_ctx:
        raise InputError(f"expected ctx_len at most the model's context ({sm.n_ctx}), found {ctx_len}")
    if optimizer not in OPTIMIZERS:
        raise InputError(f"expected optimizer in {OPTIMIZERS}, found {optimizer!r}")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InputError(f"expected lr > 0 (or None: sparsify's default for the width), found {lr!r}")
    if sm.hook_count():
        raise InputError(f"expected no recording or steering on the model while an SAE trains (it would see or change "
                         f"the activations), found {sm.hook_count()} hooks; remove them (sm.reset())")


def _train(sm: SteerModel, layer: int, train: CorpusChunks, out: Path, sparse_cfg: dict, train_cfg: dict,
           progress: bool) -> tuple[str, torch.Tensor, float, dict]:
    """Run sparsify's Trainer; ``(hookpoint, tokens since each latent fired, seconds, sparsify's config with the
    learning rate it chose)``."""
    counted = train.counted
    bs = train_cfg["batch_size"]
    per_batch = [int(counted[i:i + bs].sum()) for i in range(0, len(train), bs)]
    steps = len(per_batch)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sparsify.log", "a", encoding="utf-8") as log, \
            tqdm(total=train.tokens, desc=f"train sae layer {layer}", unit="tok", unit_scale=True,
                 disable=not progress, file=sys.stderr) as bar, \
            _sparsify(sm.device, log, _TokenBar(bar, per_batch)) as sparsify, truncated(sm, layer) as (base, hookpoint):
        cfg = sparsify.TrainConfig(sparsify.SparseCoderConfig(**sparse_cfg), hookpoints=[hookpoint],
                                   exclude_tokens=[train.sep], save_every=steps + 2, log_to_wandb=False,
                                   lr_warmup_steps=max(1, steps // 10), save_dir=str(out.parent), run_name=out.name,
                                   **train_cfg)
        trainer = sparsify.Trainer(cfg, _Rows(train.ids), base)
        start = time.perf_counter()
        trainer.fit()
        seconds = time.perf_counter() - start
        since = trainer.num_tokens_since_fired[hookpoint].detach().cpu()
        group = trainer.optimizers[0].param_groups[0]
        used = {**cfg.to_dict(), "lr": float(group.get("initial_lr", group["lr"]))}
    for pattern in _RESUME_FILES:
        for f in out.glob(pattern):
            f.unlink()
    return hookpoint, since, seconds, used


def train_sae(sm: SteerModel, hook: str, *, tokens: int, k: int = 32, expansion: int = 16,
              corpus: str | os.PathLike | None = None, ctx_len: int = 256, batch_size: int = 8, lr: float | None = None,
              optimizer: str = "signum", out: str | os.PathLike = "steerkit-sae", eval_tokens: int = 8192,
              eval_batch_size: int = 4, seed: int = 0, progress: bool = True) -> SAETrainResult:
    """Train a TopK SAE (``k`` active latents, ``expansion`` x d_model latents) at ``hook`` on ``tokens`` tokens of
    ``corpus`` (the vendored corpus by default) with sparsify, write it to ``out`` and evaluate it on
    ``eval_tokens`` held-out tokens (see the module docstring). ``ctx_len`` / ``batch_size``: tokens a row and
    rows a step; ``lr`` / ``optimizer``: sparsify's (``None``: its default for the width); ``seed``: the SAE's
    initialisation and the corpus order. ``progress``: tqdm bars on stderr.

    Examples:
        >>> r = train_sae(tiny, "blocks.0.hook_resid_post", tokens=300, k=4, expansion=2, ctx_len=32,
        ...               eval_tokens=31, out=tmp_dir / "sae", progress=False)
        >>> (r.folder / "sae.safetensors").is_file(), (r.folder / "metrics.json").is_file(), r.metrics["k"]
        (True, True, 4)
        >>> steerkit.vectors.load_sae(r.folder).site
        'blocks.0.hook_resid_post'
    """
    layer = sae_layer(sm, hook)
    _check_args(sm, tokens, k, expansion, ctx_len, batch_size, eval_tokens, optimizer, lr)
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise InputError(f"expected the output folder {out} to be a folder or not exist yet, found a file")
    # sparsify names the folder after the layer inside the base model: where the adapter keeps the blocks
    hookpoint_dir = out / f"{_layers_path(sm.hf_model.base_model, sm.adapter.block_list(sm.hf_model))}.{layer}"
    if (hookpoint_dir / "sae.safetensors").exists():
        raise InputError(f"expected no SAE in {hookpoint_dir} yet, found one; choose another output folder or remove it")
    docs = read_corpus(corpus)
    chunks = token_chunks(sm.tokenizer, docs, ctx_len, tokens + eval_tokens + 2 * ctx_len, seed=seed, progress=progress)
    train, held = split_chunks(chunks, tokens, eval_tokens, seed=seed)
    # num_latents written out too: readers that take cfg.json's num_latents at its word (0 means "use the expansion
    # factor" to sparsify) get the width
    sparse_cfg = dict(activation="topk", k=k, expansion_factor=expansion, num_latents=sm.d_model * expansion)
    train_cfg = dict(batch_size=batch_size, lr=lr, optimizer=optimizer, init_seeds=[seed],
                     dead_feature_threshold=min(DEAD_WINDOW, train.tokens))
    hookpoint, since, seconds, used = _train(sm, layer, train, out, sparse_cfg, train_cfg, progress)
    folder = out / hookpoint
    sae = load_sae(folder, site=hook, model=sm)
    window = min(DEAD_WINDOW, train.tokens)
    metrics = reconstruction_metrics(sm, sae, held.ids, ignore=[held.sep], batch_size=eval_batch_size,
                                     progress=progress)
    metrics = {"hook": hook, "model": sm.name, "model_fingerprint": sm.fingerprint(), "corpus": str(corpus or
               DEFAULT_CORPUS), "tokens": train.tokens, "seconds": round(seconds, 3),
               "tokens_per_second": round(train.tokens / seconds, 1), "k": k, "expansion": expansion,
               "d_sae": sae.d_sae, "ctx_len": ctx_len, "batch_size": batch_size, "optimizer": optimizer,
               "lr": used.get("lr"), "dead_latents": dead_latents(since, window), "dead_window_tokens": window,
               **metrics}
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return SAETrainResult(sae, folder, hook, train.tokens, seconds, metrics)
