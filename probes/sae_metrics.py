"""How good a sparse autoencoder is: sparsity, reconstruction and what splicing it into the model costs.

How it works
------------
The tensor functions compute one number each: :func:`l0` (the mean number of active latents per token),
:func:`explained_variance` (``1 - sum |x - x_hat|^2 / sum |x - mean(x)|^2`` over tokens, i.e. ``1 - FVU`` as
sparsify computes its training loss), :func:`next_token_ce` (per-token cross-entropy of a batch's logits),
:func:`ce_loss_recovered` (sae-lens's ``ce_loss_score``: ``(CE_zero_ablation - CE_spliced) / (CE_zero_ablation
- CE_clean)``) and :func:`dead_latents` (latents that fired on none of the last ``window`` training tokens).

:func:`reconstruction_metrics` runs a model over held-out token rows three times per batch, with steerkit's
own interventions at the SAE's site: clean (recording the site's activations), spliced (the activation
replaced by the SAE's reconstruction, :func:`steerkit.saesites.splice_intervention`) and zero-ablated (``Intervention.replace`` with
zeros at every position). As in sae-lens's ``get_recons_loss`` with ``ignore_tokens``, the ignored tokens'
positions (the row separator) keep their activation in the spliced run, count in no metric, and the loss is
averaged over the predictions made at the other positions.
"""
from __future__ import annotations

from typing import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import parse
from steerkit.saesites import splice_intervention
from steerkit.interventions import Intervention
from steerkit.model import SteerModel, Tokens
from steerkit.vectors import SAE

__all__ = ["l0", "explained_variance", "next_token_ce", "ce_loss_recovered", "dead_latents", "reconstruction_metrics",
           "transcoder_metrics"]


def l0(latents: Float[Tensor, "tokens d_sae"]) -> float:
    """The mean number of nonzero latents per token (row).

    Examples:
        >>> l0(torch.tensor([[0.0, 1.5, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]]))
        1.5
    """
    if latents.dim() != 2 or latents.shape[0] == 0:
        raise InputError(f"expected latents [tokens, d_sae] with at least one token, found shape "
                         f"{tuple(latents.shape)}")
    return float((latents != 0).sum(-1).double().mean())


def explained_variance(x: Float[Tensor, "tokens d"], x_hat: Float[Tensor, "tokens d"]) -> float:
    """``1 - sum |x - x_hat|^2 / sum |x - mean(x)|^2`` over the tokens (rows): the share of the activations'
    variance around their mean that the reconstruction explains (1 is perfect, 0 is no better than the mean).

    Examples:
        >>> x = torch.tensor([[1.0, 0.0], [3.0, 2.0]])          # mean (2, 1): sum of squares around it 4
        >>> explained_variance(x, torch.tensor([[1.0, 1.0], [3.0, 2.0]]))  # misses by 1: 1 - 1/4
        0.75
    """
    if x.shape != x_hat.shape or x.dim() != 2 or x.shape[0] < 2:
        raise InputError(f"expected x and x_hat of one shape [tokens >= 2, d], found {tuple(x.shape)} and "
                         f"{tuple(x_hat.shape)}")
    x, x_hat = x.double(), x_hat.double()
    total = (x - x.mean(0)).pow(2).sum()
    if float(total) == 0.0:
        raise InputError("expected activations that vary across tokens, found every row the same; explained "
                         "variance is undefined")
    return float(1 - (x - x_hat).pow(2).sum() / total)


def next_token_ce(logits: Float[Tensor, "batch pos vocab"], ids: Int[Tensor, "batch pos"],
                  counted: Bool[Tensor, "batch pos"] | None = None) -> Float[Tensor, " n"]:
    """The cross-entropy of each next-token prediction ``logits[:, t]`` -> ``ids[:, t + 1]`` at the positions
    ``t`` that ``counted`` selects (all but the last by default), as one flat tensor.

    Examples:
        >>> logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
        >>> next_token_ce(logits, torch.tensor([[0, 1, 1]]))      # -log 0.5, -log 0.1
        tensor([0.6931, 2.3026])
        >>> next_token_ce(logits, torch.tensor([[0, 1, 1]]), torch.tensor([[False, True, True]]))
        tensor([2.3026])
    """
    per = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                            reduction="none").view(ids.shape[0], -1)
    return per.flatten() if counted is None else per[counted[:, :-1].to(per.device)]


def ce_loss_recovered(ce_clean: float, ce_spliced: float, ce_zero: float) -> float:
    """The share of the loss increase from zero-ablating the site that splicing the SAE in avoids (sae-lens's
    ``ce_loss_score``): ``(ce_zero - ce_spliced) / (ce_zero - ce_clean)``; 1 means the spliced model loses
    nothing.

    Examples:
        >>> ce_loss_recovered(ce_clean=3.0, ce_spliced=3.5, ce_zero=8.0)
        0.9
    """
    if ce_zero == ce_clean:
        raise InputError(f"expected zero-ablation to change the loss, found {ce_zero} with and without it; the "
                         "recovered share is undefined")
    return (ce_zero - ce_spliced) / (ce_zero - ce_clean)


def dead_latents(tokens_since_fired: Int[Tensor, " d_sae"], window: int) -> int:
    """How many latents fired on none of the last ``window`` tokens, given each latent's count of tokens since
    it last fired (sparsify's ``Trainer.num_tokens_since_fired``).

    Examples:
        >>> dead_latents(torch.tensor([0, 5, 1_000_000, 2_300_000]), window=1_000_000)
        2
    """
    if window < 1:
        raise InputError(f"expected a window of at least 1 token, found {window}")
    return int((tokens_since_fired >= window).sum())


def _spliced_losses(sm: SteerModel, sae: SAE, ids: Tensor, keep: Tensor, zero: Tensor) -> tuple[Tensor, ...]:
    """``(x, x_hat, latents, ce_clean, ce_spliced, ce_zero)`` of one batch of rows (``keep``: the positions that
    count)."""
    w = sae.weights
    toks = Tokens(ids, torch.ones_like(ids))
    with sm.record(sae.site) as cache:
        clean = next_token_ce(sm.forward(toks), ids, keep)
    x = cache[sae.site].to(device=w.device, dtype=w.dtype)[keep.to(w.device)]
    latents = w.encode(x)
    x_hat = w.decode(latents, x)
    with sm.steer(splice_intervention(w, sae.site, positions=keep)):
        spliced = next_token_ce(sm.forward(toks), ids, keep)
    with sm.steer(Intervention.replace(sae.site, zero)):
        zeroed = next_token_ce(sm.forward(toks), ids, keep)
    return x, x_hat, latents, clean, spliced, zeroed


def reconstruction_metrics(sm: SteerModel, sae: SAE, ids: Int[Tensor, "rows pos"], *, ignore: Sequence[int] = (),
                           batch_size: int = 4, progress: bool = True) -> dict:
    """L0, explained variance and the CE losses (clean, spliced, zero-ablated, recovered) of ``sae`` on token
    rows ``ids`` (equal-length, no padding); ``ignore``: token ids whose positions count in none of them (see the
    module docstring). Three forward passes with the LM head per batch of ``batch_size`` rows.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> g = torch.Generator().manual_seed(0)
        >>> W = torch.randn(64, 256, generator=g) / 8
        >>> sae = steerkit.vectors.SAE(SAEWeights(W, torch.zeros(256), W.T.clone(), torch.zeros(64),
        ...                            architecture="topk", k=8), site="blocks.1.hook_resid_post")
        >>> m = reconstruction_metrics(tiny, sae, torch.randint(3, 1000, (2, 16), generator=g), progress=False)
        >>> m["l0"], m["eval_tokens"], sorted(m)[:3]
        (8.0, 32, ['ce_loss_clean', 'ce_loss_recovered', 'ce_loss_spliced'])
    """
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] < 2:
        raise InputError(f"expected token rows [rows, pos >= 2], found shape {tuple(ids.shape)}")
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    keep_all = ~torch.isin(ids, torch.tensor(list(ignore), dtype=ids.dtype))
    zero = torch.zeros(sae.d_in)
    parts: list[list[Tensor]] = [[] for _ in range(6)]
    starts = range(0, ids.shape[0], batch_size)
    for s in tqdm(starts, desc="evaluate sae", unit="batch", disable=not progress, leave=False):
        b = ids[s:s + batch_size].to(sm.device)
        out = _spliced_losses(sm, sae, b, keep_all[s:s + batch_size].to(sm.device), zero)
        for acc, t in zip(parts, out):
            acc.append(t.detach().cpu())
    x, x_hat, latents, clean, spliced, zeroed = (torch.cat(p) for p in parts)
    ce = {k: float(v.double().mean()) for k, v in (("clean", clean), ("spliced", spliced), ("zero", zeroed))}
    return {"l0": l0(latents), "explained_variance": explained_variance(x, x_hat),
            "ce_loss_clean": ce["clean"], "ce_loss_spliced": ce["spliced"], "ce_loss_zero_ablation": ce["zero"],
            "ce_loss_recovered": ce_loss_recovered(ce["clean"], ce["spliced"], ce["zero"]),
            "eval_tokens": int(x.shape[0])}


def _replacement(saes: Sequence[SAE], keep: Tensor) -> list[Intervention]:
    """The edits that run the model with each transcoder's prediction in place of the MLP output it predicts
    (at ``keep``'s positions): each reads its input site as the pass goes, then writes its output site."""
    seen: dict[str, Tensor] = {}
    edits = []
    for sae in saes:
        w, site = sae.weights, sae.site

        def read(h: Tensor, site: str = site) -> Tensor:
            seen[site] = h
            return h

        def predict(h: Tensor, w=w, site: str = site) -> Tensor:
            x = seen.pop(site).to(w.dtype)
            return w.decode(w.encode(x), x).to(h.dtype).reshape(h.shape)
        edits += [Intervention.apply(site, read), Intervention.apply(str(sae.output_site), predict, positions=keep)]
    return edits


def _transcoder_batch(sm: SteerModel, saes: Sequence[SAE], ids: Tensor, keep: Tensor) -> tuple[list, Tensor, ...]:
    """``([(out, prediction, latents) per transcoder], ce_clean, ce_replaced, ce_zero)`` of one batch of rows."""
    toks = Tokens(ids, torch.ones_like(ids))
    sites = [s for sae in saes for s in (sae.site, str(sae.output_site))]
    with sm.record(sites) as cache:
        clean = next_token_ce(sm.forward(toks), ids, keep)
    per = []
    for sae in saes:
        w = sae.weights
        x = cache[sae.site].to(device=w.device, dtype=w.dtype)[keep.to(w.device)]
        y = cache[str(sae.output_site)].to(device=w.device, dtype=w.dtype)[keep.to(w.device)]
        f = w.encode(x)
        per.append((y, w.decode(f, x), f))
    with sm.steer(_replacement(saes, keep)):
        replaced = next_token_ce(sm.forward(toks), ids, keep)
    zero = torch.zeros(sm.d_model)
    with sm.steer([Intervention.replace(str(sae.output_site), zero) for sae in saes]):
        zeroed = next_token_ce(sm.forward(toks), ids, keep)
    return per, clean, replaced, zeroed


def transcoder_metrics(sm: SteerModel, saes: Sequence[SAE], ids: Int[Tensor, "rows pos"], *,
                       ignore: Sequence[int] = (), batch_size: int = 4, progress: bool = True) -> dict:
    """How well transcoders (each a :class:`~steerkit.vectors.SAE` reading ``mlp.hook_in`` and predicting
    ``hook_mlp_out``) replace their MLPs on token rows ``ids``: ``per_layer`` rows (``layer``, ``fvu`` = 1 -
    explained variance of the MLP output, ``l0``) and the CE losses of the model clean, with every transcoder's
    prediction in place of its MLP output at once (the replacement model: ``ce_loss_replaced``) and with those MLP
    outputs zero-ablated, and the share recovered (:func:`ce_loss_recovered`). ``ignore``: token ids whose positions
    keep their activations and count in no metric. Three forward passes with the LM head per batch.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> g = torch.Generator().manual_seed(0)
        >>> tcs = [steerkit.vectors.SAE(SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
        ...            torch.randn(128, 64, generator=g) / 8, torch.zeros(64), architecture="topk", k=8,
        ...            transcoder=True), site=f"blocks.{l}.mlp.hook_in", output_site=f"blocks.{l}.hook_mlp_out")
        ...        for l in (0, 1)]
        >>> m = transcoder_metrics(tiny, tcs, torch.randint(3, 1000, (2, 16), generator=g), progress=False)
        >>> [r["layer"] for r in m["per_layer"]], m["per_layer"][0]["l0"], m["eval_tokens"]
        ([0, 1], 8.0, 32)
    """
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] < 2:
        raise InputError(f"expected token rows [rows, pos >= 2], found shape {tuple(ids.shape)}")
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    if not saes or any(not sae.weights.transcoder for sae in saes):
        raise InputError("expected one or more transcoders (SAEs with an output site), found "
                         f"{'none' if not saes else 'an autoencoder among them'}; use reconstruction_metrics for SAEs")
    keep_all = ~torch.isin(ids, torch.tensor(list(ignore), dtype=ids.dtype))
    parts: list[list[tuple[Tensor, ...]]] = [[] for _ in saes]
    ces: list[list[Tensor]] = [[], [], []]
    for s in tqdm(range(0, ids.shape[0], batch_size), desc="evaluate transcoders", unit="batch", disable=not progress,
                  leave=False):
        per, *ce = _transcoder_batch(sm, saes, ids[s:s + batch_size].to(sm.device),
                                     keep_all[s:s + batch_size].to(sm.device))
        for acc, t in zip(parts, per):
            acc.append(tuple(v.detach().cpu() for v in t))
        for acc, t in zip(ces, ce):
            acc.append(t.detach().cpu())
    rows = []
    for sae, acc in zip(saes, parts):
        y, y_hat, f = (torch.cat([a[i] for a in acc]) for i in range(3))
        rows.append({"layer": parse(sae.site, sm.n_layers).layer, "fvu": 1 - explained_variance(y, y_hat), "l0": l0(f)})
    clean, replaced, zeroed = (float(torch.cat(c).double().mean()) for c in ces)
    return {"per_layer": rows, "ce_loss_clean": clean, "ce_loss_replaced": replaced, "ce_loss_zero_ablation": zeroed,
            "ce_loss_recovered": ce_loss_recovered(clean, replaced, zeroed), "eval_tokens": int(keep_all.sum())}
