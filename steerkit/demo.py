"""The quick-start pipeline, on the embedded default model unless another is named.

Load SmolLM2-135M-Instruct (or ``model``, on ``device`` in ``dtype``, as ``steerkit.load_model`` takes
them), record the residual stream at the last prompt
token for two small prompt sets (joyful vs. gloomy statements), take the
difference of their means at a middle layer as a direction, and print greedy
generations without and with that direction added to the output of the block.
"""
from __future__ import annotations

import time

import torch

from steerkit.hooks.names import resid_post
from steerkit.model import load_model

POSITIVE = [
    "I just got wonderful news and I feel fantastic!", "What a beautiful, sunny, joyful morning.",
    "I love spending time with my wonderful friends.", "This is the happiest day of my life!",
    "Everything went perfectly and I am thrilled.", "The party was delightful and full of laughter.",
    "I am so grateful and excited about the future.", "Our holiday was amazing, we loved every minute.",
]
NEGATIVE = [
    "I just got terrible news and I feel awful.", "What a grey, miserable, depressing morning.",
    "I hate being stuck alone with nobody to talk to.", "This is the worst day of my life.",
    "Everything went wrong and I am devastated.", "The party was dreadful and full of arguments.",
    "I am so anxious and hopeless about the future.", "Our holiday was a disaster, we hated every minute.",
]
TEST_PROMPTS = ["Tell me about your weekend.", "Describe the city you live in.", "Write one sentence about Mondays."]


def main(quick: bool = False, layer: int | None = None, scale: float = 6.0, *, model=None, device="auto",
         dtype="auto") -> int:
    """Run the pipeline; ``layer`` defaults to the block 40% of the way up (12 of the default's 30)."""
    t0 = time.time()
    sm = load_model(model, device=device, dtype=dtype)
    print(f"loaded {sm} on {sm.device} in {sm.dtype} in {time.time() - t0:.1f}s")
    layer = round(0.4 * sm.n_layers) if layer is None else layer
    hooks = resid_post(range(sm.n_layers))
    with sm.record(hooks, positions="last") as cache:
        sm.forward(POSITIVE, chat=True)
        sm.forward(NEGATIVE, chat=True)
    acts = cache.stack()                         # [n_layers, 16, d_model]
    pos, neg = acts[:, : len(POSITIVE)], acts[:, len(POSITIVE):]
    diff = pos.mean(1) - neg.mean(1)             # [n_layers, d_model]
    # how well each layer's direction separates the two sets (projection gap / pooled std)
    u = diff / diff.norm(dim=-1, keepdim=True)
    pp, pn = (pos * u[:, None]).sum(-1), (neg * u[:, None]).sum(-1)
    sep = (pp.mean(1) - pn.mean(1)) / torch.sqrt(0.5 * (pp.var(1) + pn.var(1)) + 1e-8)
    print("separation (d') per layer:", " ".join(f"{l}:{s:.1f}" for l, s in enumerate(sep.tolist())))
    v = diff[layer]
    print(f"direction: difference of means at blocks.{layer}.hook_resid_post, |v| = {v.norm():.2f}")
    prompts = TEST_PROMPTS[:2] if quick else TEST_PROMPTS
    n = 24 if quick else 40
    base = sm.generate(prompts, max_new_tokens=n, chat=True)
    with sm.edit(f"blocks.{layer}.hook_resid_post", add=v, scale=scale):
        pos_s = sm.generate(prompts, max_new_tokens=n, chat=True)
    with sm.edit(f"blocks.{layer}.hook_resid_post", add=v, scale=-scale):
        neg_s = sm.generate(prompts, max_new_tokens=n, chat=True)
    for p, b, s1, s2 in zip(prompts, base, pos_s, neg_s):
        print(f"\n### {p}\n  baseline : {b!r}\n  +{scale:g} v   : {s1!r}\n  -{scale:g} v   : {s2!r}")
    print(f"\ndone in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
