"""``steerkit sae ...``: sparse autoencoders on the loaded model.

Wiring: :func:`steerkit.cli.build_parser` imports this module and calls :func:`register` with its sub-parsers
object; each verb sets its own function.

* ``steerkit sae train --hook blocks.L.hook_resid_post --tokens N [--k 32 --expansion 16 --corpus PATH --out DIR
  --ctx-len 256 --batch-size 8 --lr LR --optimizer signum --eval-tokens 8192 --seed 0]`` trains a TopK SAE with
  sparsify (:func:`steerkit.probes.train_sae`, the ``sae`` extra) on the vendored corpus or ``--corpus``
  (a .txt / .md / .jsonl file, optionally .xz / .gz / .bz2, or a folder of them), writes sparsify's folder
  ``DIR/layers.L`` with ``metrics.json`` beside the weights, and prints the metrics (``--json``: one JSON
  object).
* ``steerkit sae eval SAE --prompts FILE [--site HOOK --batch-size 8 --chat --include-special-tokens --json]``
  evaluates an SAE (a sae-lens or sparsify folder, a steerkit SAE file or a store reference, checked against
  the model) on the prompts with :func:`steerkit.probes.sae_eval`: L0, explained variance and CE loss
  recovered as sae-lens's evals define them, with the clean, spliced and zero-ablated losses.

Exit codes: 0 success, 2 bad input (one ``steerkit: error:`` line), 1 an operating-system error.
"""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

from steerkit.cli._common import add_model_options, check_min, check_output_path, load_model_from, read_prompts
from steerkit.errors import InputError
from steerkit.probes import read_corpus, sae_eval, train_sae
from steerkit.probes.sae_train import OPTIMIZERS
from steerkit.vectors import load_sae

_HOOK = re.compile(r"blocks\.[0-9]+\.hook_resid_post")
_SHOWN = ("tokens", "seconds", "tokens_per_second", "l0", "explained_variance", "dead_latents", "dead_window_tokens",
          "ce_loss_clean", "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "eval_tokens")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sae", help="sparse autoencoders: train one with sparsify, evaluate one",
                              description="Sparse autoencoders on the loaded model.")
    sub = p.add_subparsers(dest="sae_cmd", metavar="VERB")
    sub.required = True
    t = sub.add_parser("train", help="train a TopK SAE at a residual stream site with sparsify",
                       description="Train a TopK sparse autoencoder with EleutherAI's sparsify on the vendored "
                                   "public-domain corpus (or --corpus), running the model only up to the SAE's "
                                   "layer; writes sparsify's folder OUT/layers.L with metrics.json.")
    add_model_options(t)
    t.add_argument("--hook", required=True, help="the site: blocks.L.hook_resid_post (the output of layer L)")
    t.add_argument("--tokens", type=int, required=True, help="training tokens (rounded up to whole rows)")
    t.add_argument("--k", type=int, default=32, help="active latents per token (default 32)")
    t.add_argument("--expansion", type=int, default=16, help="latents per d_model (default 16)")
    t.add_argument("--corpus", default=None, help="a .txt/.md/.jsonl file (optionally .xz/.gz/.bz2) or a folder of "
                   "them (default: the vendored State of the Union + Moby-Dick corpus)")
    t.add_argument("--out", default="steerkit-sae", help="output folder (default ./steerkit-sae)")
    t.add_argument("--ctx-len", type=int, default=256, help="tokens a row (default 256)")
    t.add_argument("--batch-size", type=int, default=8, help="rows a training step (default 8)")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default: sparsify's for the width)")
    t.add_argument("--optimizer", default="signum", choices=OPTIMIZERS, help="sparsify's optimizer (default signum)")
    t.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens for the metrics (default 8192)")
    t.add_argument("--seed", type=int, default=0, help="SAE initialisation and corpus order (default 0)")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    t.set_defaults(func=run_train)
    e = sub.add_parser("eval", help="L0, explained variance and CE loss recovered of an SAE on prompts",
                       description="Evaluate a sparse autoencoder on prompts as sae-lens's evals do: L0 and explained "
                                   "variance of its reconstruction, and the CE loss recovered when the model runs "
                                   "with the reconstruction in place of the activation.")
    add_model_options(e)
    e.add_argument("sae", metavar="SAE", help="a sae-lens or sparsify folder, a steerkit SAE file or a store reference")
    e.add_argument("--prompts", required=True, help="prompts (.json, .jsonl or text, one a line)")
    e.add_argument("--site", default=None, help="the hook the SAE reads, replacing what its folder says")
    e.add_argument("--batch-size", type=int, default=8, help="prompts a batch (default 8)")
    e.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    e.add_argument("--include-special-tokens", action="store_true", help="count BOS / EOS / PAD tokens too "
                   "(sae-lens's evals leave them out)")
    e.add_argument("--override", action="store_true", help="an SAE made on another model's weights: warn, not fail")
    e.add_argument("--quiet", action="store_true", help="no progress bar")
    e.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    e.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    check_min(args.batch_size, "--batch-size", 1)
    prompts = read_prompts(args.prompts)
    sae = load_sae(args.sae, site=args.site)  # a missing or malformed SAE fails before the model loads
    sm = load_model_from(args)
    r = sae_eval(sm, sae, prompts, batch_size=args.batch_size, chat=args.chat,
                 exclude_special_tokens=not args.include_special_tokens, override=args.override,
                 progress=not args.quiet)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"SAE {args.sae} at {r['site']} ({sae.d_sae} latents) on {len(prompts)} prompts")
    for key, v in r.items():
        if key != "site":
            print(f"  {key:<22} {v:.4f}" if isinstance(v, float) else f"  {key:<22} {v}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    if not _HOOK.fullmatch(args.hook):
        raise InputError(f"expected --hook blocks.L.hook_resid_post (the output of layer L, the site sparsify trains "
                         f"at), found {args.hook!r:.120}")
    for flag, value, low in (("--tokens", args.tokens, 1), ("--k", args.k, 1), ("--expansion", args.expansion, 1),
                             ("--ctx-len", args.ctx_len, 2), ("--batch-size", args.batch_size, 1),
                             ("--eval-tokens", args.eval_tokens, 2)):
        check_min(value, flag, low)
    if args.lr is not None and not args.lr > 0:
        raise InputError(f"expected --lr > 0, found {args.lr}; leave it out for sparsify's default")
    check_output_path(args.out, "--out", folder=True)
    if args.corpus is not None:
        read_corpus(args.corpus)  # a missing or unreadable corpus fails before the model loads
    sm = load_model_from(args)
    r = train_sae(sm, args.hook, tokens=args.tokens, k=args.k, expansion=args.expansion, corpus=args.corpus,
                  ctx_len=args.ctx_len, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
                  out=args.out, eval_tokens=args.eval_tokens, seed=args.seed, progress=not args.quiet)
    if args.json:
        print(json.dumps(r.to_json()))
        return 0
    print(f"SAE at {r.folder} ({r.sae.d_sae} latents, k={args.k}, {args.hook})")
    for key in _SHOWN:
        v = r.metrics[key]
        print(f"  {key:<22} {v:.4f}" if isinstance(v, float) else f"  {key:<22} {v}")
    return 0
