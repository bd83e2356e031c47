"""Training a set of TopK transcoders, one per block, in one pass over a corpus, with EleutherAI's sparsify.

How it works
------------
:func:`train_transcoders` drives sparsify's ``Trainer`` in its transcoder mode (``transcode=True``): each
transcoder reads what block ``l``'s MLP reads (``blocks.{l}.mlp.hook_in``, the MLP module's input) and is trained
to predict what it writes (``blocks.{l}.hook_mlp_out``), with sparsify's FVU loss. Every chosen block trains
in the same forward passes (one hook per MLP module), and the model runs only up to the highest chosen block
(:func:`steerkit.probes.sae_train.truncated`). The data, sparsify's settings and its messages are as for
:func:`steerkit.probes.train_sae` (rows that start with the separator, which is excluded; the vendored corpus
by default).

* **Which modules.** The MLP modules come from the adapter (``adapter.mlp_module``) and are found inside the
  base model by identity, never by a typed path. Families whose ``hook_mlp_out`` is not the MLP module's own
  output (a norm after the MLP: Gemma 2 / 3, OLMo 2) are refused: a transcoder trained on the module would not
  predict the site.
* **Precision.** ``precision="float32"`` (the default) trains as sparsify does on a CPU. ``"bfloat16"`` trains
  under bfloat16 autocast (the model's forward pass and the encoders' matrix products in bfloat16; the weights,
  the decoder, the loss and the optimizer stay float32): faster on a device with bfloat16 matrix instructions,
  but on the default model a 500,000-token run of all 30 blocks diverged (held-out FVU in the thousands at every
  block) where float32 does not, so it is for experiments only.
* **Checkpoints and resuming.** At most every ``checkpoint_seconds`` (after a step) the transcoders, the
  optimizer and scheduler states, the step and sparsify's dead-latent counters are written to
  ``OUT/checkpoint`` as one folder swapped in atomically (:func:`steerkit.storage.files.atomic_folder`): an
  interruption at any moment leaves the last whole checkpoint. ``OUT/train.json`` holds the run's settings. A
  later call with the same settings resumes from the checkpoint (the rows already trained on are skipped, so
  the result is the uninterrupted run's); other settings are refused, naming the ones that differ. The
  checkpoint is removed when the run finishes.
* **Output.** sparsify's folders ``OUT/layers.{l}.mlp/`` (``cfg.json`` + ``sae.safetensors``), which
  :func:`steerkit.load_transcoders` reads as a :class:`~steerkit.vectors.Transcoders` set (every block trained)
  and :func:`steerkit.load_sae` one by one; ``OUT/metrics.json``.
* **Metrics** (:func:`steerkit.probes.sae_metrics.transcoder_metrics`, on held-out rows): per block the FVU
  (``1 - explained variance`` of ``hook_mlp_out``), L0 and dead latents (fired on none of the last
  :data:`~steerkit.probes.sae_train.DEAD_WINDOW` training tokens); for the replacement model (every trained
  block's MLP output replaced by its transcoder's prediction at once) the CE loss and the CE loss recovered
  against zero-ablating those MLP outputs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import parse_layers
from steerkit.model import SteerModel
from steerkit.storage.files import atomic_folder, atomic_write_bytes
from steerkit.vectors import SAE, Transcoders, load_sae, load_transcoders

from .sae_corpus import DEFAULT_CORPUS, CorpusChunks, read_corpus, split_chunks, token_chunks
from .sae_metrics import dead_latents, transcoder_metrics
from .sae_train import DEAD_WINDOW, _check_args, _Rows, _sparsify, _TokenBar, truncated

__all__ = ["TranscoderTrainResult", "train_transcoders", "mlp_hookpoints", "autocast_bf16", "CHECKPOINT", "SETTINGS_FILE",
           "PRECISIONS"]

#: the checkpoint folder inside the output folder
CHECKPOINT = "checkpoint"
#: the run's settings, beside the checkpoint (a resumed run must have the same)
SETTINGS_FILE = "train.json"
_METRICS = "metrics.json"
#: the precisions a run may ask for
PRECISIONS = ("float32", "bfloat16")


def autocast_bf16(device: torch.device, precision: str) -> bool:
    """Whether a run on ``device`` asking for ``precision`` trains under bfloat16 autocast.

    Examples:
        >>> autocast_bf16(torch.device("cpu"), "float32"), autocast_bf16(torch.device("cpu"), "bfloat16")
        (False, True)
    """
    if precision not in PRECISIONS:
        raise InputError(f"expected precision in {PRECISIONS}, found {precision!r}")
    if precision == "bfloat16" and device.type not in ("cpu", "cuda"):
        raise InputError(f"expected a CPU or CUDA device for bfloat16 autocast, found {device.type}; use float32")
    return precision == "bfloat16"


@dataclasses.dataclass
class TranscoderTrainResult:
    """Trained transcoders: sparsify's folders under :attr:`folder` (one ``layers.{l}.mlp`` per block in
    :attr:`layers`), the training ``tokens`` and ``seconds`` (of this call; ``resumed_tokens`` were trained
    before an interruption), and :attr:`metrics` (also in ``folder / "metrics.json"``: ``per_layer`` rows and
    the replacement model's CE losses).

    Examples:
        >>> r = train_transcoders(tiny, "all", tokens=300, k=4, expansion=2, ctx_len=32, eval_tokens=62,
        ...                       out=tmp_dir / "tc", progress=False)
        >>> r.layers, sorted(p.name for p in r.folder.glob("layers.*"))
        ([0, 1, 2, 3], ['layers.0.mlp', 'layers.1.mlp', 'layers.2.mlp', 'layers.3.mlp'])
        >>> r.transcoders(tiny).n_layers, sorted(r.metrics["per_layer"][0])
        (4, ['dead_latents', 'fvu', 'l0', 'layer'])
    """

    folder: Path
    layers: list[int]
    tokens: int
    resumed_tokens: int
    seconds: float
    metrics: dict

    def transcoders(self, model: Any = None) -> Transcoders:
        """The trained set as one :class:`~steerkit.vectors.Transcoders` (every block must have been trained),
        checked against ``model`` and recording it when given (:func:`steerkit.load_transcoders`)."""
        return load_transcoders(self.folder, model)

    def saes(self) -> list[SAE]:
        """Each trained block's transcoder as a :class:`~steerkit.vectors.SAE` (reading ``mlp.hook_in``)."""
        return [load_sae(self.folder / name) for name in self.metrics["folders"]]

    def to_json(self) -> dict:
        return {"folder": str(self.folder), "layers": self.layers, "tokens": self.tokens,
                "resumed_tokens": self.resumed_tokens, "seconds": self.seconds, "metrics": self.metrics}


def mlp_hookpoints(sm: SteerModel, base: nn.Module, layers: Sequence[int]) -> list[str]:
    """The names inside ``base`` (the base model) of the MLP modules of ``layers``, found by identity; an
    :class:`~steerkit.errors.InputError` for a family whose ``hook_mlp_out`` is not that module's output.

    Examples:
        >>> mlp_hookpoints(tiny, tiny.hf_model.base_model, [0, 2])
        ['layers.0.mlp', 'layers.2.mlp']
    """
    names = {id(m): n for n, m in base.named_modules()}
    out = []
    for layer in layers:
        mlp = sm.adapter.mlp_module(sm.hf_model, layer)
        writes = sm.adapter.mlp_out_module(sm.hf_model, layer)
        if writes is not mlp or id(mlp) not in names:
            raise InputError(f"expected blocks.{layer}.hook_mlp_out to be the MLP module's own output to train a "
                             f"transcoder on it, found {type(writes).__name__} after the MLP ({sm.adapter.name} "
                             "normalises the MLP's output); transcoders are trained here for pre-norm families "
                             "such as Llama, Mistral, Qwen")
        out.append(names[id(mlp)])
    return out


def _settings(sm: SteerModel, layers: list[int], args: dict) -> dict:
    return {"model": sm.name, "model_fingerprint": sm.fingerprint(), "layers": layers, **args}


def _check_resume(out: Path, settings: dict) -> bool:
    """Whether ``out`` holds a checkpoint of this run to resume (an InputError for another run's)."""
    if (out / _METRICS).is_file():
        raise InputError(f"expected no finished transcoders in {out} yet, found {out / _METRICS}; choose another "
                         "output folder or remove it")
    for stale in out.glob(f".{CHECKPOINT}.*"):  # a swap cut off by a hard kill
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    if not (out / CHECKPOINT / "state.pt").is_file():
        return False
    try:
        before = json.loads((out / SETTINGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        before = None
    if not isinstance(before, dict):
        raise InputError(f"expected {out / SETTINGS_FILE} beside the checkpoint in {out}, found it missing or "
                         "unreadable; remove the checkpoint folder to start over")
    differ = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
    if differ:
        shown = ", ".join(f"{k}: {before.get(k)!r:.40} then, {settings.get(k)!r:.40} now" for k in differ[:4])
        raise InputError(f"expected the settings of the interrupted run in {out} to resume it, found other ones "
                         f"({shown}); run again with those settings, or choose another output folder")
    return True


def _write_checkpoint(trainer: Any, path: Path, step: int) -> None:
    """sparsify's checkpoint layout (what ``Trainer.load_state`` reads), written with the parameters the optimizer
    is training: sparsify's own checkpoint swaps a schedule-free optimizer's averaged parameters in first, which
    a resumed run would then train from."""
    for name, sae in trainer.saes.items():
        sae.save_to_disk(str(path / name))
    for i, scheduler in enumerate(trainer.lr_schedulers):
        torch.save(scheduler.state_dict(), path / f"lr_scheduler_{i}.pt")
    for i, optimizer in enumerate(trainer.optimizers):
        torch.save(optimizer.state_dict(), path / f"optimizer_{i}.pt")
    torch.save({"global_step": step}, path / "state.pt")
    torch.save({"num_tokens_since_fired": trainer.num_tokens_since_fired, "best_loss": trainer.best_loss},
               path / "rank_0_state.pt")
    trainer.cfg.save_json(str(path / "config.json"))


def _atomic_save(trainer: Any, ckpt: Path, every: float) -> None:
    """Replace ``trainer.save`` (called by sparsify after a step) with an atomic checkpoint at most every
    ``every`` seconds. sparsify saves before counting the step it just took: the step written is the next one,
    so a resumed run skips exactly the rows already trained on."""
    last = [time.monotonic()]

    def save() -> None:
        if time.monotonic() - last[0] < every:
            return
        with atomic_folder(ckpt, if_exists="replace") as tmp:
            _write_checkpoint(trainer, tmp, trainer.global_step + 1)
        last[0] = time.monotonic()
    trainer.save = save


def _init_biases(trainer: Any, base: nn.Module, hookpoints: Sequence[str], ids: torch.Tensor, sep: int) -> None:
    """sparsify's first-step initialisation (encoder bias ``-mean(input) @ W_enc.T``, decoder bias ``mean(output)``
    over the first batch's counted tokens), done here in float32 before training: under autocast sparsify's
    own would make the encoder bias a bfloat16 parameter for the whole run."""
    device = next(base.parameters()).device
    x = ids.to(device)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str):
        return lambda module, args, out: seen.__setitem__(name, (args[0], out))
    handles = [base.get_submodule(h).register_forward_hook(keep(h)) for h in hookpoints]
    try:
        with torch.no_grad():
            base(x)
    finally:
        for handle in handles:
            handle.remove()
    mask = (x != sep).flatten()
    with torch.no_grad():
        for h in hookpoints:
            sae, (inp, out) = trainer.saes[h], seen[h]
            mean_in = inp.flatten(0, 1)[mask].float().mean(0)
            sae.encoder.bias.data = (-mean_in @ sae.encoder.weight.data.T).to(sae.dtype)
            sae.b_dec.data = out.flatten(0, 1)[mask].float().mean(0).to(sae.dtype)


def _final_weights(trainer: Any) -> None:
    """Put the weights to keep in place: a schedule-free optimizer's (sparsify's ``signum``) averaged ones."""
    for optimizer in trainer.optimizers:
        if callable(getattr(optimizer, "eval", None)):
            optimizer.eval()


def _fit(sm: SteerModel, layers: list[int], train: CorpusChunks, out: Path, sparse_cfg: dict, train_cfg: dict,
         resume: bool, every: float, bf16: bool, progress: bool) -> tuple[list[str], dict, float, int]:
    """Run sparsify's Trainer over every layer at once; ``(folder names, tokens since each latent fired per
    folder, seconds, tokens trained before this call)``."""
    bs = train_cfg["batch_size"]
    per_batch = [int(train.counted[i:i + bs].sum()) for i in range(0, len(train), bs)]
    ckpt = out / CHECKPOINT
    with open(out / "sparsify.log", "a", encoding="utf-8") as log, \
            tqdm(total=train.tokens, desc=f"train transcoders ({len(layers)} blocks)", unit="tok", unit_scale=True,
                 disable=not progress, file=sys.stderr) as bar, truncated(sm, max(layers)) as (base, _):
        hookpoints = mlp_hookpoints(sm, base, layers)
        with _sparsify(sm.device, log, _TokenBar(bar, per_batch)) as sparsify:
            # finetune: sparsify's own first-step initialisation is skipped (_init_biases does it in float32)
            cfg = sparsify.TrainConfig(sparsify.SparseCoderConfig(**sparse_cfg), hookpoints=hookpoints,
                                       exclude_tokens=[train.sep], save_every=1, log_to_wandb=False,
                                       lr_warmup_steps=max(1, len(per_batch) // 10), save_dir=str(out),
                                       run_name=CHECKPOINT, finetune="steerkit", **train_cfg)
            trainer = sparsify.Trainer(cfg, _Rows(train.ids), base)
            done = 0
            if not resume:
                _init_biases(trainer, base, hookpoints, train.ids[:bs], train.sep)
            else:
                trainer.load_state(str(ckpt))
                done = sum(per_batch[:trainer.global_step])
                bar.update(done)
                bar.set_postfix_str(f"resumed at step {trainer.global_step}")
                # the bar advances per batch from where the run stopped
                sparsify.trainer.tqdm = lambda *a, **k: _TokenBar(bar, per_batch[trainer.global_step:])
            _atomic_save(trainer, ckpt, every)
            start = time.perf_counter()
            with torch.autocast(sm.device.type, dtype=torch.bfloat16, enabled=bf16):
                trainer.fit()
            seconds = time.perf_counter() - start
            since = {h: trainer.num_tokens_since_fired[h].detach().cpu() for h in hookpoints}
            _final_weights(trainer)
            for h in hookpoints:
                with atomic_folder(out / h, if_exists="replace") as tmp:
                    trainer.saes[h].save_to_disk(str(tmp))
    return hookpoints, since, seconds, done


def train_transcoders(sm: SteerModel, layers: str | int | Sequence[int] = "all", *, tokens: int, k: int = 32,
                      expansion: int = 8, skip_connection: bool = False, corpus: str | os.PathLike | None = None,
                      ctx_len: int = 256, batch_size: int = 8, lr: float | None = None, optimizer: str = "signum",
                      out: str | os.PathLike = "steerkit-transcoders", eval_tokens: int = 8192,
                      eval_batch_size: int = 4, seed: int = 0, checkpoint_seconds: float = 300.0,
                      precision: str = "float32", progress: bool = True) -> TranscoderTrainResult:
    """Train a TopK transcoder (``k`` active latents, ``expansion`` x d_model latents, ``skip_connection``: plus
    a linear skip) for each block in ``layers`` (``"all"``, indices, or text such as ``"0-11"``) on ``tokens``
    tokens of ``corpus`` in one pass, checkpointing to ``out`` at most every ``checkpoint_seconds`` and resuming
    from an interrupted run's checkpoint there (``precision``: see the module docstring); evaluate on ``eval_tokens`` held-out tokens (see the module
    docstring). The other arguments are :func:`~steerkit.probes.train_sae`'s.

    Examples:
        >>> r = train_transcoders(tiny, [1, 2], tokens=200, k=4, expansion=2, ctx_len=32, eval_tokens=62,
        ...                       out=tmp_dir / "tc2", progress=False)
        >>> [row["layer"] for row in r.metrics["per_layer"]], steerkit.load_sae(r.folder / "layers.2.mlp").site
        ([1, 2], 'blocks.2.mlp.hook_in')
    """
    chosen = parse_layers(layers, sm.n_layers, what="layers")
    if not chosen:
        raise InputError("expected at least one layer to train transcoders for, found none")
    _check_args(sm, tokens, k, expansion, ctx_len, batch_size, eval_tokens, optimizer, lr)
    if not (isinstance(checkpoint_seconds, (int, float)) and checkpoint_seconds >= 0):
        raise InputError(f"expected checkpoint_seconds >= 0, found {checkpoint_seconds!r}")
    bf16 = autocast_bf16(sm.device, precision)
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise InputError(f"expected the output folder {out} to be a folder or not exist yet, found a file")
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(sm, chosen, dict(tokens=tokens, k=k, expansion=expansion, skip_connection=skip_connection,
                                          corpus=str(corpus or DEFAULT_CORPUS), ctx_len=ctx_len,
                                          batch_size=batch_size, lr=lr, optimizer=optimizer,
                                          eval_tokens=eval_tokens, seed=seed, bfloat16_autocast=bf16))
    resume = _check_resume(out, settings)
    atomic_write_bytes(out / SETTINGS_FILE, (json.dumps(settings, indent=2) + "\n").encode())
    docs = read_corpus(corpus)
    chunks = token_chunks(sm.tokenizer, docs, ctx_len, tokens + eval_tokens + 2 * ctx_len, seed=seed, progress=progress)
    train, held = split_chunks(chunks, tokens, eval_tokens, seed=seed)
    sparse_cfg = dict(activation="topk", k=k, expansion_factor=expansion, num_latents=sm.d_model * expansion,
                      transcode=True, skip_connection=skip_connection)
    train_cfg = dict(batch_size=batch_size, lr=lr, optimizer=optimizer, init_seeds=[seed],
                     dead_feature_threshold=min(DEAD_WINDOW, train.tokens))
    names, since, seconds, done = _fit(sm, chosen, train, out, sparse_cfg, train_cfg, resume, checkpoint_seconds,
                                       bf16, progress)
    saes = [load_sae(out / n, model=sm) for n in names]
    window = min(DEAD_WINDOW, train.tokens)
    metrics = transcoder_metrics(sm, saes, held.ids, ignore=[held.sep], batch_size=eval_batch_size, progress=progress)
    for row, n in zip(metrics["per_layer"], names):
        row["dead_latents"] = dead_latents(since[n], window)
    trained = train.tokens - done
    metrics = {**settings, "folders": names, "tokens": train.tokens, "seconds": round(seconds, 3),
               "tokens_per_second": round(trained / seconds, 1) if seconds > 0 else None, "resumed_tokens": done,
               "d_sae": saes[0].d_sae, "dead_window_tokens": window, **metrics}
    atomic_write_bytes(out / _METRICS, (json.dumps(metrics, indent=2) + "\n").encode())
    shutil.rmtree(out / CHECKPOINT, ignore_errors=True)
    return TranscoderTrainResult(out, chosen, train.tokens, done, seconds, metrics)
