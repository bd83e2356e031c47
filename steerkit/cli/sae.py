"""``steerkit sae ...``: sparse autoencoders on the loaded model.

Wiring: :func:`steerkit.cli.build_parser` imports this module and calls :func:`register` with its sub-parsers
object; each verb sets its own function.

* ``steerkit sae train --hook blocks.L.hook_resid_post --tokens N [--k 32 --expansion 16 --corpus PATH --out DIR
  --ctx-len 256 --batch-size 8 --lr LR --optimizer signum --eval-tokens 8192 --seed 0]`` trains a TopK SAE with
  sparsify (:func:`steerkit.probes.train_sae`, the ``sae`` extra) on the vendored corpus or ``--corpus``
  (a .txt / .md / .jsonl file, optionally .xz / .gz / .bz2, or a folder of them), writes sparsify's folder
  ``DIR/layers.L`` with ``metrics.json`` beside the weights, and prints the metrics (``--json``: one JSON
  object).
* ``steerkit sae train --transcoder --layers all --tokens N [--expansion 8 --skip-connection --checkpoint-seconds
  300 ...]`` trains a TopK transcoder for every chosen block (``--layers``: ``all`` or ``0-11,20``) in one pass
  (:func:`steerkit.probes.train_transcoders`), checkpointing to ``--out`` and resuming an interrupted run there
  when run again with the same flags; writes ``DIR/layers.L.mlp`` folders and ``DIR/metrics.json`` and prints
  per-block FVU, L0 and dead latents and the replacement model's CE loss recovered.
* ``steerkit sae eval SAE --prompts FILE [--site HOOK --batch-size 8 --chat --include-special-tokens --json]``
  evaluates an SAE (a sae-lens or sparsify folder, a steerkit SAE file or a store reference, checked against
  the model) on the prompts with :func:`steerkit.probes.sae_eval`: L0, explained variance and CE loss
  recovered as sae-lens's evals define them, with the clean, spliced and zero-ablated losses.
* ``steerkit sae find "TEXT" --sae SAE [--text-file FILE --site HOOK --k 10 --chat --override --json]`` lists the
  latents that fire most on one text (:func:`steerkit.probes.top_latents`): each one's peak and mean activation,
  on how many tokens it is active and the token where it peaks, the first token (the attention sink) not counted
  (``--json``: ``TopLatents.to_dict()``).
* ``steerkit sae report --sae SAE --latent I --dataset FILE [--site HOOK --top 20 --context 8 --after 3
  --batch-size 16 --chat --html OUT.html --json]`` reads one latent over a text set
  (:func:`steerkit.probes.feature_report`): its density, top-activating contexts (the firing token marked
  ``[[token]]``), logit effects and nearest decoder neighbours; ``--html`` writes the contexts, shaded by
  activation, and the report's figure to one HTML file (``--json``: ``FeatureReport.to_dict()``).

The SAE of every verb but ``train`` is loaded before the model (a bad path fails at once) and checked against it
(``--override``: a fingerprint or depth mismatch warns instead).

Exit codes: 0 success, 2 bad input (one ``steerkit: error:`` line), 1 an operating-system error.
"""
from __future__ import annotations

import argparse
import html
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from steerkit.cli._common import (add_model_options, check_min, check_output_path, load_model_from, read_prompts,
                                  read_text_file)
from steerkit.errors import InputError
from steerkit.hooks.names import LAYERS_HELP, parse_layers
from steerkit.probes import (FeatureReport, TranscoderTrainResult, feature_report, read_corpus, sae_eval, top_latents,
                             train_sae, train_transcoders)
from steerkit.probes.plots.require import PLOTLY_MISSING
from steerkit.probes.sae_train import OPTIMIZERS
from steerkit.probes.transcoder_train import PRECISIONS
from steerkit.vectors import load_sae

_HOOK = re.compile(r"blocks\.[0-9]+\.hook_resid_post")
_SHOWN = ("tokens", "seconds", "tokens_per_second", "l0", "explained_variance", "dead_latents", "dead_window_tokens",
          "ce_loss_clean", "ce_loss_spliced", "ce_loss_zero_ablation", "ce_loss_recovered", "eval_tokens")


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sae", help="sparse autoencoders: train one with sparsify, evaluate one, find the "
                              "latents of a text, report on one latent",
                              description="Sparse autoencoders on the loaded model.")
    sub = p.add_subparsers(dest="sae_cmd", metavar="VERB")
    sub.required = True
    t = sub.add_parser("train", help="train a TopK SAE at a residual stream site with sparsify",
                       description="Train a TopK sparse autoencoder with EleutherAI's sparsify on the vendored "
                                   "public-domain corpus (or --corpus), running the model only up to the SAE's "
                                   "layer; writes sparsify's folder OUT/layers.L with metrics.json.")
    add_model_options(t)
    t.add_argument("--hook", default=None, help="the site: blocks.L.hook_resid_post (the output of layer L)")
    t.add_argument("--transcoder", action="store_true", help="train transcoders (mlp.hook_in -> hook_mlp_out) for "
                   "the blocks of --layers instead of an SAE at --hook")
    t.add_argument("--layers", default=None, help=f"with --transcoder: the blocks ({LAYERS_HELP})")
    t.add_argument("--skip-connection", action="store_true", help="with --transcoder: a linear skip as well")
    t.add_argument("--precision", default="float32", choices=PRECISIONS, help="with --transcoder: float32 (default) "
                   "or bfloat16 autocast (faster, for experiments: it diverged on the default model)")
    t.add_argument("--checkpoint-seconds", type=float, default=300.0, help="with --transcoder: at most this long "
                   "between checkpoints in --out (default 300); run again with the same flags to resume")
    t.add_argument("--tokens", type=int, required=True, help="training tokens (rounded up to whole rows)")
    t.add_argument("--k", type=int, default=32, help="active latents per token (default 32)")
    t.add_argument("--expansion", type=int, default=None, help="latents per d_model (default 16; 8 for --transcoder)")
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
    _register_find(sub)
    _register_report(sub)
    return p


def _sae_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sae", required=True, metavar="SAE", help="a sae-lens or sparsify folder, a steerkit SAE file "
                   "or a store reference")
    p.add_argument("--site", default=None, help="the hook the SAE reads, replacing what its folder says")
    p.add_argument("--chat", action="store_true", help="wrap each text in the chat template (default: raw text)")
    p.add_argument("--override", action="store_true", help="an SAE made on another model's weights: warn, not fail")


def _register_find(sub: Any) -> None:
    f = sub.add_parser("find", help="the latents of an SAE that fire most on a text",
                       description="List the latents of a sparse autoencoder with the highest peak activation on "
                                   "one text: each one's peak and mean activation over the text's tokens, on how "
                                   "many tokens it is active and the token where it peaks. The first token, where "
                                   "the model's attention sink sits, is not counted.")
    add_model_options(f)
    f.add_argument("text", nargs="?", default=None, metavar="TEXT", help="the text (or --text-file)")
    f.add_argument("--text-file", default=None, metavar="FILE", help="read the text from a UTF-8 file (all of it, "
                   "less one final newline) instead of TEXT")
    _sae_options(f)
    f.add_argument("--k", type=int, default=10, help="latents to list (default 10)")
    f.add_argument("--json", action="store_true", help="print the result as one JSON object")
    f.set_defaults(func=run_find)


def _register_report(sub: Any) -> None:
    r = sub.add_parser("report", help="one latent of an SAE over a text set: contexts, density, logit effects",
                       description="Read one latent of a sparse autoencoder over a text set, as sae-dashboard "
                                   "shows it: its activation density, its top-activating contexts (at most one "
                                   "per text), the tokens its decoder row pushes up and down through the "
                                   "unembedding, and its nearest latents by decoder cosine.")
    add_model_options(r)
    _sae_options(r)
    r.add_argument("--latent", type=int, required=True, help="the latent's index, 0..d_sae-1")
    r.add_argument("--dataset", required=True, metavar="FILE", help="the texts (.json, .jsonl or text, one a line)")
    r.add_argument("--top", type=int, default=20, help="contexts to show (default 20)")
    r.add_argument("--context", type=int, default=8, help="tokens shown before the firing one (default 8)")
    r.add_argument("--after", type=int, default=3, help="tokens shown after the firing one (default 3)")
    r.add_argument("--batch-size", type=int, default=16, help="texts a batch (default 16)")
    r.add_argument("--html", default=None, metavar="OUT.html", help="also write the contexts, shaded by "
                   "activation, and the figure (histogram, logit effects, neighbours; plotly.js from its CDN) "
                   "to this HTML file")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    r.set_defaults(func=run_report)


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


def _check_train_args(args: argparse.Namespace) -> None:
    if args.transcoder:
        if args.hook is not None or args.layers is None:
            raise InputError("expected --layers (and no --hook) with --transcoder: transcoders read each block's "
                             f"mlp.hook_in, found {'--hook' if args.hook is not None else 'no --layers'}; e.g. "
                             "--transcoder --layers all")
        parse_layers(args.layers, what="--layers")
        check_min(args.checkpoint_seconds, "--checkpoint-seconds", 0)
    else:
        if args.hook is None or not _HOOK.fullmatch(args.hook):
            raise InputError(f"expected --hook blocks.L.hook_resid_post (the output of layer L, the site sparsify "
                             f"trains at), found {args.hook!r:.120}; or --transcoder --layers all for transcoders")
        if args.layers is not None or args.skip_connection or args.precision != "float32":
            raise InputError("expected --layers, --skip-connection and --precision only with --transcoder, found them "
                             "with --hook")
    if args.expansion is None:
        args.expansion = 8 if args.transcoder else 16
    for flag, value, low in (("--tokens", args.tokens, 1), ("--k", args.k, 1), ("--expansion", args.expansion, 1),
                             ("--ctx-len", args.ctx_len, 2), ("--batch-size", args.batch_size, 1),
                             ("--eval-tokens", args.eval_tokens, 2)):
        check_min(value, flag, low)
    if args.lr is not None and not args.lr > 0:
        raise InputError(f"expected --lr > 0, found {args.lr}; leave it out for sparsify's default")
    check_output_path(args.out, "--out", folder=True)
    if args.corpus is not None:
        read_corpus(args.corpus)  # a missing or unreadable corpus fails before the model loads


def _print_transcoders(r: TranscoderTrainResult) -> None:
    m = r.metrics
    resumed = f", resumed after {r.resumed_tokens} tokens" if r.resumed_tokens else ""
    print(f"transcoders at {r.folder} ({len(r.layers)} blocks, {m['d_sae']} latents each, k={m['k']}{resumed})")
    print(f"  {'layer':>5} {'fvu':>8} {'l0':>6} {'dead':>6}")
    for row in m["per_layer"]:
        print(f"  {row['layer']:>5} {row['fvu']:>8.4f} {row['l0']:>6.1f} {row['dead_latents']:>6}")
    for key in ("tokens", "seconds", "tokens_per_second", "ce_loss_clean", "ce_loss_replaced", "ce_loss_zero_ablation",
                "ce_loss_recovered", "eval_tokens"):
        v = m[key]
        print(f"  {key:<22} {v:.4f}" if isinstance(v, float) else f"  {key:<22} {v}")


def run_train(args: argparse.Namespace) -> int:
    _check_train_args(args)
    sm = load_model_from(args)
    common = dict(tokens=args.tokens, k=args.k, expansion=args.expansion, corpus=args.corpus, ctx_len=args.ctx_len,
                  batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, out=args.out,
                  eval_tokens=args.eval_tokens, seed=args.seed, progress=not args.quiet)
    if args.transcoder:
        tr = train_transcoders(sm, args.layers, skip_connection=args.skip_connection,
                               checkpoint_seconds=args.checkpoint_seconds, precision=args.precision, **common)
        if args.json:
            print(json.dumps(tr.to_json()))
        else:
            _print_transcoders(tr)
        return 0
    r = train_sae(sm, args.hook, **common)
    if args.json:
        print(json.dumps(r.to_json()))
        return 0
    print(f"SAE at {r.folder} ({r.sae.d_sae} latents, k={args.k}, {args.hook})")
    for key in _SHOWN:
        v = r.metrics[key]
        print(f"  {key:<22} {v:.4f}" if isinstance(v, float) else f"  {key:<22} {v}")
    return 0


def _text_of(args: argparse.Namespace) -> str:
    if (args.text is None) == (args.text_file is None):
        raise InputError("expected the text as TEXT or --text-file FILE, found "
                         + ("both" if args.text is not None else "neither"))
    if args.text_file is None:
        text = args.text
    else:
        text = read_text_file(args.text_file)
        text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise InputError("expected a non-empty text, found an empty one; give the text to read")
    return text


def run_find(args: argparse.Namespace) -> int:
    check_min(args.k, "--k", 1)
    text = _text_of(args)
    sae = load_sae(args.sae, site=args.site)  # a missing or malformed SAE fails before the model loads
    sm = load_model_from(args)
    sae.check(sm, override=args.override)
    r = top_latents(sm, sae, text, k=args.k, site=args.site, chat=args.chat)
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    counted = "" if len(r.tokens) == 1 else " (the first, the attention sink, not counted)"
    print(f"SAE {args.sae} at {r.site} ({sae.d_sae} latents): the top {len(r.rows)} on {len(r.tokens)} "
          f"tokens{counted}")
    print(f"  {'latent':>7} {'max':>9} {'mean':>9} {'count':>6}  peak token (position)")
    for row in r.rows:
        print(f"  {row['latent']:>7} {row['max']:>9.4g} {row['mean']:>9.4g} {row['count']:>6}  "
              f"{row['token']!r} ({row['position']})")
    return 0


def _visible(token: str) -> str:
    return token.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _marked(c: dict) -> str:
    """A context of a :class:`~steerkit.probes.FeatureReport` as one line, the firing token marked ``[[token]]``
    (newlines and tabs written as ``\\n`` and ``\\t``)."""
    return "".join(f"[[{_visible(t)}]]" if j == c["index"] else _visible(t) for j, t in enumerate(c["tokens"]))


def _pairs(items: list, fmt: str) -> str:
    return ", ".join(fmt.format(repr(a) if isinstance(a, str) else a, b) for a, b in items)


def _write_report_html(path: str, rep: FeatureReport, sae_name: str) -> None:
    fig = rep.plot(title=f"latent {rep.latent} of {sae_name} at {rep.site}")
    title = html.escape(f"latent {rep.latent} at {rep.site}")
    page = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head><body>\n"
            f"{rep.contexts_html()}\n{fig.to_html(full_html=False, include_plotlyjs='cdn')}\n</body></html>\n")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")


def run_report(args: argparse.Namespace) -> int:
    for flag, value, low in (("--top", args.top, 1), ("--context", args.context, 0), ("--after", args.after, 0),
                             ("--batch-size", args.batch_size, 1)):
        check_min(value, flag, low)
    if args.html is not None:
        check_output_path(args.html, "--html")
        if importlib.util.find_spec("plotly") is None:  # the figure needs it: fail before the model loads
            raise InputError(f"{PLOTLY_MISSING} (--html writes a figure)")
    texts = read_prompts(args.dataset)
    sae = load_sae(args.sae, site=args.site)  # a missing or malformed SAE fails before the model loads
    if not 0 <= args.latent < sae.d_sae:
        raise InputError(f"expected --latent in 0..{sae.d_sae - 1} (the SAE has {sae.d_sae} latents), found "
                         f"{args.latent}")
    sm = load_model_from(args)
    sae.check(sm, override=args.override)
    rep = feature_report(sm, sae, args.latent, texts, site=args.site, top=args.top, context=args.context,
                         after=args.after, batch_size=args.batch_size, chat=args.chat, progress=not args.quiet)
    if args.html is not None:
        _write_report_html(args.html, rep, args.sae)
    if args.json:
        print(json.dumps(rep.to_dict()))
        return 0
    active = rep.values.numel()
    print(f"latent {rep.latent} of SAE {args.sae} at {rep.site}: density {rep.density:.4g} ({active} of "
          f"{rep.n_tokens} tokens in {len(texts)} texts)")
    print(f"top contexts ({len(rep.contexts)}):" if rep.contexts else "top contexts: none (the latent never fires)")
    for c in rep.contexts:
        print(f"  {c['value']:>9.4g}  text {c['doc']} token {c['position']}: {_marked(c)}")
    print(f"top logit effects:    {_pairs(rep.top_logits, '{} {:+.3f}')}")
    print(f"bottom logit effects: {_pairs(rep.bottom_logits, '{} {:+.3f}')}")
    print(f"nearest decoder neighbours (cosine): {_pairs(rep.neighbours, '{} {:.3f}')}")
    if args.html is not None:
        print(f"wrote the contexts and the figure to {args.html}")
    return 0
