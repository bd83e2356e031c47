"""sae-lens's side of tests/integration/test_sae_lens.py, run in ``.venv-saelens`` (sae-lens 6 pins TransformerLens < 4,
which steerkit's environment does not hold). Tensors cross the two environments as safetensors files.

``build OUT``: makes sae-lens SAEs of each architecture with fixed seeds, saves each with sae-lens's own
``save_model`` (BatchTopK: ``save_inference_model``, its JumpReLU form) under ``OUT/saelens/NAME``, and
writes fixed inputs ``x`` with sae-lens's ``encode`` / ``decode`` of them to ``OUT/io/NAME.safetensors``.

``load OUT``: loads every folder under ``OUT/steerkit/`` (written by steerkit's ``save(format="saelens")``)
with ``sae_lens.SAE.load_from_disk`` and writes its ``encode`` / ``decode`` of the inputs in
``OUT/steerkit_io/NAME.safetensors`` to ``OUT/back/NAME.safetensors``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE
from sae_lens.saes.batchtopk_sae import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig
from sae_lens.saes.gated_sae import GatedSAE, GatedSAEConfig
from sae_lens.saes.jumprelu_sae import JumpReLUSAE, JumpReLUSAEConfig
from sae_lens.saes.sae import SAEMetadata
from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig
from sae_lens.saes.transcoder import SkipTranscoder, SkipTranscoderConfig

D_IN, D_SAE, N_HEADS, ROWS = 32, 128, 4, 24


def meta(hook: str, **kw) -> SAEMetadata:
    return SAEMetadata(hook_name=hook, model_name="tiny-llama", **kw)


def specs() -> dict:
    """name -> (sae class, config): every architecture steerkit reads, and the options that change the math."""
    resid = "blocks.1.hook_resid_post"
    return {
        "standard": (StandardSAE, StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta(resid))),
        "standard_layer_norm": (StandardSAE, StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, apply_b_dec_to_input=False,
                                                               normalize_activations="layer_norm", metadata=meta(resid))),
        "standard_hook_z": (StandardSAE, StandardSAEConfig(d_in=D_IN, d_sae=D_SAE, reshape_activations="hook_z",
                                                           metadata=meta("blocks.1.attn.hook_z"))),
        "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta("blocks.0.hook_mlp_out"))),
        "jumprelu_norm_rescale": (JumpReLUSAE, JumpReLUSAEConfig(d_in=D_IN, d_sae=D_SAE,
                                                                 normalize_activations="constant_norm_rescale",
                                                                 metadata=meta(resid))),
        "topk": (TopKSAE, TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8, metadata=meta(resid))),
        "topk_rescaled": (TopKSAE, TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8, rescale_acts_by_decoder_norm=True,
                                                 metadata=meta("blocks.1.hook_resid_pre"))),
        "gated": (GatedSAE, GatedSAEConfig(d_in=D_IN, d_sae=D_SAE, metadata=meta(resid))),
        "skip_transcoder": (SkipTranscoder, SkipTranscoderConfig(
            d_in=D_IN, d_sae=D_SAE, d_out=D_IN, apply_b_dec_to_input=False,
            metadata=meta("blocks.1.hook_resid_mid", hook_name_out="blocks.1.hook_mlp_out"))),
    }


@torch.no_grad()
def randomize(sae: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases and thresholds on the scale where a share of the latents fire)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(sae.named_parameters()):
        scale = 0.3 if name.startswith(("b_", "r_mag")) else 0.25
        p.copy_(torch.randn(p.shape, generator=g) * scale)
        if name == "threshold":
            p.copy_(torch.rand(p.shape, generator=g) * 0.5)


def inputs(name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(ROWS, D_IN, generator=g) * 2.0 + 0.5
    return x.reshape(ROWS, N_HEADS, D_IN // N_HEADS) if name.endswith("hook_z") else x


def outputs(sae, x: torch.Tensor) -> dict[str, torch.Tensor]:
    f = sae.encode(x)
    y = sae.forward(x) if isinstance(sae, SkipTranscoder) else sae.decode(f)  # a skip transcoder's W_skip is in forward
    return {"x": x.contiguous(), "f": f.contiguous(), "y": y.contiguous()}


@torch.no_grad()
def build(out: Path) -> None:
    (out / "io").mkdir(parents=True, exist_ok=True)
    for seed, (name, (cls, cfg)) in enumerate(specs().items()):
        sae = cls(cfg)
        randomize(sae, seed)
        sae.save_model(out / "saelens" / name)
        save_file(outputs(sae, inputs(name, seed)), out / "io" / f"{name}.safetensors")
    # BatchTopK: trained with a batch-level top-k, saved for inference as JumpReLU with one threshold
    cfg = BatchTopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=8, metadata=meta("blocks.1.hook_resid_post"))
    train = BatchTopKTrainingSAE(cfg)
    randomize(train, 99)
    train.topk_threshold = torch.tensor(0.4, dtype=torch.double)
    train.save_inference_model(out / "saelens" / "batchtopk")
    sae = SAE.load_from_disk(out / "saelens" / "batchtopk")
    save_file(outputs(sae, inputs("batchtopk", 99)), out / "io" / "batchtopk.safetensors")


@torch.no_grad()
def load(out: Path) -> None:
    (out / "back").mkdir(parents=True, exist_ok=True)
    for folder in sorted((out / "steerkit").iterdir()):
        sae = SAE.load_from_disk(folder)
        x = load_file(out / "steerkit_io" / f"{folder.name}.safetensors")["x"]
        save_file(outputs(sae, x), out / "back" / f"{folder.name}.safetensors")
        print(folder.name, type(sae).__name__, sae.cfg.architecture())


if __name__ == "__main__":
    {"build": build, "load": load}[sys.argv[1]](Path(sys.argv[2]))
