"""sae-lens's side of ``tests/probes/test_sae_eval.py``'s metric check, run in ``.venv-saelens`` (sae-lens 6 pins
TransformerLens < 4, which steerkit's environment does not hold; and TransformerLens 3 has no SmolLM2 config, so
sae-lens's ``run_evals`` cannot run the model itself). Tensors cross the two environments as safetensors files.

``metrics IN``: ``IN/sae`` is a sae-lens folder (steerkit's ``save(format="saelens")``), loaded with
``sae_lens.SAE.load_from_disk``; ``IN/batches.safetensors`` holds, per batch ``i``, what steerkit's model computed:
``x.i`` (the site's clean activations ``[batch, pos, d_in]``), ``ids.i`` (the token ids), ``tokens.i`` (the ids
with every position that does not count set to -1, which is passed as sae-lens's ``ignore_tokens``) and the
logits of the clean, spliced and zero-ablated runs (``clean.i``, ``spliced.i``, ``zero.i``). A stand-in model
hands those to sae-lens's own ``get_sparsity_and_variance_metrics`` and ``get_downstream_reconstruction_metrics``
(through its ``get_recons_loss``): the cache, the per-token losses (TransformerLens's ``lm_cross_entropy_loss``,
what ``HookedTransformer`` returns with ``loss_per_token=True``), and, for the spliced run, the activation its
replacement hook writes, kept as ``replaced.i``. Writes ``IN/saelens_metrics.json`` and
``IN/saelens_replaced.safetensors``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
from sae_lens.evals import get_downstream_reconstruction_metrics, get_sparsity_and_variance_metrics
from sae_lens.training.activation_scaler import ActivationScaler
from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss

IGNORED = -1


class Batches:
    """The stand-in activation store: each batch's tokens in turn (``tokens.i``)."""

    def __init__(self, tensors: dict, n: int):
        self.tensors, self.n, self.i = tensors, n, 0

    def get_batch_tokens(self, _batch_size: int) -> torch.Tensor:
        t = self.tensors[f"tokens.{self.i % self.n}"]
        self.i += 1
        return t


class Model:
    """The stand-in model: the recorded activations and logits of the batch whose tokens it is given."""

    def __init__(self, tensors: dict, n: int, hook: str):
        self.tensors, self.hook = tensors, hook
        self.by_tokens = {self._key(tensors[f"tokens.{i}"]): i for i in range(n)}
        self.replaced: dict[str, torch.Tensor] = {}

    @staticmethod
    def _key(tokens: torch.Tensor) -> bytes:
        return tokens.numpy().tobytes()

    def _batch(self, tokens: torch.Tensor) -> int:
        return self.by_tokens[self._key(tokens)]

    def _loss(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        return lm_cross_entropy_loss(logits, self.tensors[f"ids.{i}"], per_token=True)

    def run_with_cache(self, tokens, names_filter=None, **_kw):
        return None, {self.hook: self.tensors[f"x.{self._batch(tokens)}"]}

    def __call__(self, tokens, return_type="both", loss_per_token=True, **_kw):
        i = self._batch(tokens)
        return self.tensors[f"clean.{i}"], self._loss(i, self.tensors[f"clean.{i}"])

    def run_with_hooks(self, tokens, return_type="both", fwd_hooks=(), loss_per_token=True, **_kw):
        i = self._batch(tokens)
        (hook, fn), = fwd_hooks
        assert hook == self.hook, (hook, self.hook)
        out = fn(self.tensors[f"x.{i}"].clone(), hook=None)
        if bool((out == 0).all()):  # the zero-ablation hook
            return self.tensors[f"zero.{i}"], self._loss(i, self.tensors[f"zero.{i}"])
        self.replaced[f"replaced.{i}"] = out.contiguous()
        return self.tensors[f"spliced.{i}"], self._loss(i, self.tensors[f"spliced.{i}"])


@torch.no_grad()
def metrics(folder: Path) -> None:
    sae = SAE.load_from_disk(folder / "sae")
    tensors = load_file(folder / "batches.safetensors")
    n = len([k for k in tensors if k.startswith("x.")])
    hook = sae.cfg.metadata.hook_name
    model = Model(tensors, n, hook)
    size = int(tensors["tokens.0"].shape[0])
    sparsity, _ = get_sparsity_and_variance_metrics(
        sae, model, Batches(tensors, n), ActivationScaler(), n_batches=n, compute_l2_norms=False,  # type: ignore[arg-type]
        compute_sparsity_metrics=True, compute_variance_metrics=True, compute_featurewise_density_statistics=False,
        eval_batch_size_prompts=size, model_kwargs={}, ignore_tokens=[IGNORED])
    recons = get_downstream_reconstruction_metrics(
        sae, model, Batches(tensors, n), ActivationScaler(), compute_kl=False, compute_ce_loss=True,  # type: ignore[arg-type]
        n_batches=n, eval_batch_size_prompts=size, ignore_tokens=[IGNORED])
    (folder / "saelens_metrics.json").write_text(json.dumps({**sparsity, **recons, "hook_name": hook}))
    save_file(model.replaced, folder / "saelens_replaced.safetensors")
    print(type(sae).__name__, hook, json.dumps(recons))


if __name__ == "__main__":
    {"metrics": metrics}[sys.argv[1]](Path(sys.argv[2]))
