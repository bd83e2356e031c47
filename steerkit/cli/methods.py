"""``steerkit temporal | norms | mi-peaks | caa | region | critique | induction | ioi``: published methods on a model (default: the embedded
SmolLM2-135M-Instruct), with progress on stderr, a JSON report (``--report``) and artifacts saved to
the vector store (``--out``, default ``$STEERKIT_STORE`` or ``./steerkit-store``; ``--no-save``).

Each verb builds the method's config from its flags and calls the ``run`` of
:data:`steerkit.probes.methods.REGISTRY` under the verb's name; the result's ``to_json()`` is the
report and its ``artifacts(sm)`` what is saved.

* ``temporal``: the temporal divergence profile on generated event pairs; saves ``temporal-tau``
  (a ``SteeringVector``: the dataset-mean tau of the source layer, injected at every later layer with
  the profile's ``LayerSchedule``) and ``temporal-schedule``; ``--eval N`` also measures order-question
  accuracy with and without injection (beta picked on a separate dev split).
* ``norms``: residual norm per layer on a prompts file (or built-in prompts).
* ``mi-peaks``: MI (HSIC) per generation step against the reference solution on GSM8K questions.
* ``caa``: the CAA vector on the project's A/B set; saves ``caa-vector`` (all layers) and evaluates
  p(matching letter) per layer and multiplier.
* ``region``: the concise-reasoning region (Hou et al.): verbose and concise solutions of training
  problems by the model, features at step-boundary tokens, the fitted polyhedron saved as
  ``region-concise`` (a ``Region``), and generated tokens / accuracy with and without the projection on
  held-out problems.
* ``critique``: the hidden critique vector (Phan et al.): block outputs over the final-answer span of
  templated arithmetic traces with an inserted error (recoveries, or error-containing traces when the
  model rarely recovers) minus clean traces; error-detection F1 ("Is there a wrong step?", Yes vs No
  logits) per layer and alpha on held-out traces; saves ``critique-vector`` (one layer) with provenance.
* ``induction``: the induction score of every head (attention from the repeated half of a random
  token sequence to the token after each token's first occurrence) and the per-token loss on the
  first vs the repeated half; ``--html`` writes the score heatmap and the loss curve.
* ``ioi``: indirect-object identification prompt pairs (clean: the subject named again; corrupted:
  the indirect object named again), activation patching of ``resid_pre`` and each head's ``z`` with
  the logit difference IO - S; ``--html`` writes the heatmaps; ``--ray`` runs each grid's layers on Ray
  workers (:mod:`steerkit.executors`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import functools
import json
import os
import sys
from pathlib import Path

import torch

from steerkit.cli._common import (add_model_options, add_ray_options, check_min, check_output_path, check_store_path,
                                  model_with_workers, ray_executor, read_prompts)
from steerkit.errors import InputError
from steerkit.hooks.names import parse_layers
from steerkit.probes.methods import REGISTRY
from steerkit.probes.methods.caa import CAAConfig
from steerkit.probes.methods import induction as induction_method
from steerkit.probes.methods import ioi as ioi_method
from steerkit.probes.methods.critique import CritiqueConfig
from steerkit.probes.methods.mi import MIConfig
from steerkit.probes.methods.norms import NormsConfig
from steerkit.probes.methods.region import RegionConfig
from steerkit.probes.methods.temporal import TemporalConfig
from steerkit.vectors import Store

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def register(subparsers) -> None:
    def common(p):
        add_model_options(p)
        p.add_argument("--out", default=None, help="vector store folder")
        p.add_argument("--no-save", action="store_true")
        p.add_argument("--report", default=None, metavar="FILE", help="write all numbers as JSON")
        p.add_argument("--quiet", action="store_true")

    p = subparsers.add_parser("temporal", help="temporal divergence profile and injection (Shin et al.)")
    common(p)
    p.add_argument("--n-pairs", type=int, default=60)
    p.add_argument("--eval", type=int, default=0, metavar="N", help="order questions to evaluate (0: skip)")
    p.add_argument("--n-dev", type=int, default=40)
    p.add_argument("--betas", default="0,0.5,1,2,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", type=int, default=None, help="source layer (default: the profile's peak; when "
                   "that is the last layer, the peak among the earlier layers, since nothing follows it)")
    p.set_defaults(func=run, method="temporal")

    p = subparsers.add_parser("norms", help="residual norm growth per layer")
    common(p)
    p.add_argument("prompts", nargs="?", default=None, help="prompts file (default: built-in prompts)")
    p.add_argument("--drift-tokens", type=int, default=32, help="greedy tokens for the attention-drift part "
                   "(sink / prompt / recent / generated mass per layer and step; 0 skips it)")
    p.add_argument("--window", type=int, default=4, help="recent-token window of the drift part (default 4)")
    p.add_argument("--passes", type=int, default=3, help="passes through the blocks in the re-applied-blocks "
                   "chain (1: the model only; default 3)")
    p.add_argument("--html", default=None, metavar="FILE", help="write the three figures to one HTML file")
    p.set_defaults(func=run, method="norms")

    p = subparsers.add_parser("mi-peaks", help="MI (HSIC) per generation step and its peaks (Qian et al.)")
    common(p)
    p.add_argument("--data", default=None, help="jsonl with question/answer (default: the vendored "
                   "steerkit/data/reasoning/gsm8k_test_first300.jsonl)")
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--layer", type=int, default=None, help="default: two thirds deep")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=float, default=2.0, help="peak threshold mean + k std")
    p.add_argument("--eval", default=None, choices=["arith", "gsm8k"], help="also compare greedy decoding, "
                   "representation recycling and thinking-token continuation on these problems")
    p.add_argument("--n-eval", type=int, default=30, help="problems for --eval (default 30)")
    p.add_argument("--recycle-layer", type=int, default=None, help="block run twice on thinking tokens "
                   "(default: --layer)")
    p.add_argument("--thinking-words", default=None, help="comma-separated thinking words (default: "
                   "So,Wait,Hmm,Therefore,Let,Now,Then,First,But)")
    p.add_argument("--continue-with", default="Wait", help="thinking word appended for the continuation "
                   "(empty: skip that condition)")
    p.add_argument("--eval-tokens", type=int, default=96, help="new tokens per answer in --eval")
    p.set_defaults(func=run, method="mi-peaks")

    p = subparsers.add_parser("caa", help="Contrastive Activation Addition vector (Rimsky et al.)")
    common(p)
    p.add_argument("--layers", default=None, help="layers to evaluate, e.g. 6,10-14 or all (default: every 3rd)")
    p.add_argument("--multipliers", default="-2,-1,0,1,2")
    p.set_defaults(func=run, method="caa")

    p = subparsers.add_parser("region", help="concise-reasoning region and its projection (Hou et al.)")
    common(p)
    p.add_argument("--data", default="arith", choices=["arith", "gsm8k", "mix"],
                   help="templated arithmetic, the vendored GSM8K problems, or half of each")
    p.add_argument("--level", default="easy", choices=["easy", "medium"], help="arithmetic difficulty")
    p.add_argument("--n-train", type=int, default=40)
    p.add_argument("--n-test", type=int, default=30, help="held-out problems to evaluate (0: fit only)")
    p.add_argument("--layer", type=int, default=None, help="default: two thirds deep")
    p.add_argument("--n-components", type=int, default=10)
    p.add_argument("--n-clusters", type=int, default=8)
    p.add_argument("--strength", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=96, help="evaluation budget per problem")
    p.add_argument("--train-max-new-tokens", type=int, default=96)
    p.add_argument("--keep", default="correct", choices=["correct", "answered", "all"],
                   help="training solutions to fit on (correct falls back to answered below --min-kept)")
    p.add_argument("--min-kept", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, method="region")

    p = subparsers.add_parser("critique", help="hidden critique vector and error-detection F1 (Phan et al.)")
    common(p)
    p.add_argument("--n", type=int, default=40, help="training questions (clean + corrupted trace each)")
    p.add_argument("--n-eval", type=int, default=None, help="held-out step sequences to score, half of them "
                   "erroneous (default: --n)")
    p.add_argument("--layers", default=None, help="comma-separated layers to sweep, or 'all' (default: every "
                   "5th layer and the last, a subset to save CPU time; the API default is every layer)")
    p.add_argument("--alphas", default=",".join(f"{a:g}" for a in [round(-1 + 0.2 * i, 1) for i in range(11)]),
                   help="comma-separated steering strengths (default -1..1 step 0.2)")
    p.add_argument("--contrast", default="auto", choices=["auto", "recovery", "error"],
                   help="recoveries vs clean, error-containing vs clean, or recovery when enough items recover")
    p.add_argument("--min-recoveries", type=int, default=4)
    p.add_argument("--layer", type=int, default=None, help="layer whose vector is saved (default: the layer "
                   "of the best F1 among the swept ones)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, method="critique")

    p = subparsers.add_parser("induction", help="induction heads on repeated random tokens (Olsson et al.)")
    common(p)
    p.add_argument("--n-seqs", type=int, default=32, help="random sequences (default 32)")
    p.add_argument("--seq-len", type=int, default=50, help="tokens per half (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", default=None, help="layers to score, e.g. 6,10-14 (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=10, help="top heads to list (default 10)")
    p.add_argument("--html", default=None, metavar="FILE", help="write the score heatmap and loss curve to one "
                   "HTML file")
    p.set_defaults(func=run, method="induction")

    p = subparsers.add_parser("ioi", help="indirect-object identification by activation patching (Wang et al.)")
    common(p)
    p.add_argument("--n-templates", type=int, default=len(ioi_method.TEMPLATES), help="the first N built-in "
                   f"templates (default all {len(ioi_method.TEMPLATES)})")
    p.add_argument("--n-names", type=int, default=len(ioi_method.NAMES), help="the first N built-in (IO, S) name "
                   f"pairs (default all {len(ioi_method.NAMES)})")
    p.add_argument("--hooks", default=",".join(ioi_method.HOOKS), help="comma-separated hooks to patch (default "
                   "resid_pre,z)")
    p.add_argument("--batch-size", type=int, default=32, help="patched runs per forward pass (default 32)")
    p.add_argument("--html", default=None, metavar="FILE", help="write the heatmaps to one HTML file")
    add_ray_options(p, work="run each patching grid's layers",
                    here="this process loads the model too: it builds the prompt pairs and aggregates the grids")
    p.set_defaults(func=run, method="ioi")


def _log(args, *a):
    if not args.quiet:
        print(*a, file=sys.stderr)


def _store(args):
    return Store(args.out) if args.out else Store()


def _floats(text: str, flag: str) -> tuple:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise InputError(f"expected comma-separated numbers in {flag}, found {text!r} ({e})") from None


def _layers(text: str | None, n_layers: int | None = None):
    """``--layers`` (indices and ranges, or all) as a tuple of layers (``None`` when not given); without the
    model's ``n_layers`` (before it loads) only its syntax is checked."""
    if not text:
        return None
    layers = parse_layers(text, n_layers, what="--layers")
    return layers if isinstance(layers, str) else tuple(layers)


def _save(sm: "SteerModel", args, res) -> list[str]:
    """Save the result's artifacts (unless ``--no-save``) and say where."""
    if args.no_save:
        return []
    store = _store(args)
    refs = [store.save(name, art) for name, art in res.artifacts(sm).items()]
    print(f"saved {', '.join(refs)} to {store.root}")
    return refs


def _precheck(args) -> None:
    """Refuse flags that are wrong whatever the model, before it loads."""
    check_store_path(args.out, "--out")
    if args.report:
        check_output_path(args.report, "--report")
    m = args.method
    for flag in ("layer", "source", "recycle_layer"):
        check_min(getattr(args, flag, None), f"--{flag.replace('_', '-')}", 0, "layers are 0-based block indices")
    if m == "temporal":
        check_min(args.n_pairs, "--n-pairs", 2)
        check_min(args.eval, "--eval", 0)
        check_min(args.n_dev, "--n-dev", 1)
        if not _floats(args.betas, "--betas"):
            raise InputError(f"expected at least one number in --betas, found {args.betas!r}")
    elif m == "norms":
        if args.prompts:
            read_prompts(args.prompts)
        check_min(args.drift_tokens, "--drift-tokens", 0)
        check_min(args.window, "--window", 1)
        check_min(args.passes, "--passes", 1, "1 runs the model once")
        if args.html:
            check_output_path(args.html, "--html")
    elif m == "mi-peaks":
        if args.data is not None and not Path(args.data).is_file():
            raise InputError(f"expected a jsonl of question/answer rows at {args.data}, found "
                             f"{'a folder' if Path(args.data).is_dir() else 'nothing'} there; check the path")
        for flag in ("n", "max_new_tokens", "n_eval", "eval_tokens"):
            check_min(getattr(args, flag), f"--{flag.replace('_', '-')}", 1)
    elif m == "caa":
        _layers(args.layers)
        if not _floats(args.multipliers, "--multipliers"):
            raise InputError(f"expected at least one number in --multipliers, found {args.multipliers!r}")
    elif m == "region":
        check_min(args.n_train, "--n-train", 2)
        check_min(args.n_test, "--n-test", 0)
        for flag in ("n_components", "n_clusters", "max_new_tokens", "train_max_new_tokens", "min_kept",
                     "batch_size"):
            check_min(getattr(args, flag), f"--{flag.replace('_', '-')}", 1)
    elif m == "critique":
        check_min(args.n, "--n", 1)
        check_min(args.n_eval, "--n-eval", 2)
        check_min(args.min_recoveries, "--min-recoveries", 0)
        check_min(args.batch_size, "--batch-size", 1)
        _layers(args.layers)
        if not _floats(args.alphas, "--alphas"):
            raise InputError(f"expected at least one number in --alphas, found {args.alphas!r}")
    elif m == "induction":
        check_min(args.n_seqs, "--n-seqs", 1)
        check_min(args.seq_len, "--seq-len", 2)
        check_min(args.batch_size, "--batch-size", 1)
        check_min(args.top_k, "--top-k", 1)
        _layers(args.layers)
        if args.html:
            check_output_path(args.html, "--html")
    elif m == "ioi":
        for flag, n in (("n_templates", len(ioi_method.TEMPLATES)), ("n_names", len(ioi_method.NAMES))):
            v = getattr(args, flag)
            if not 1 <= v <= n:
                raise InputError(f"expected --{flag.replace('_', '-')} in 1..{n} (the built-in ones), found {v}")
        check_min(args.batch_size, "--batch-size", 1)
        hooks = _hooks_arg(args.hooks)
        if not hooks:
            raise InputError(f"expected at least one of {ioi_method.HOOKS} in --hooks, found {args.hooks!r}")
        if args.html:
            check_output_path(args.html, "--html")


def _hooks_arg(text: str) -> tuple:
    hooks = tuple(h.strip() for h in text.split(",") if h.strip())
    bad = [h for h in hooks if h not in ioi_method.HOOKS]
    if bad or len(set(hooks)) != len(hooks):
        raise InputError(f"expected --hooks as distinct names among {ioi_method.HOOKS}, found {text!r}")
    return hooks


def _write_html(path: str, figures: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, fig in enumerate(figures):
            f.write(fig.to_html(full_html=i == 0, include_plotlyjs="cdn" if i == 0 else False))
    print(f"wrote the figures to {path}")


def run(args) -> int:
    _precheck(args)
    executor = ray_executor(args) if getattr(args, "ray", None) is not None else None
    torch_threads()
    with model_with_workers(args, executor) as sm:
        report = {"model": sm.name}
        fns: dict[str, Callable[..., None]] = {
            "temporal": _temporal, "norms": _norms, "mi-peaks": _mi, "caa": _caa, "region": _region,
            "critique": _critique, "induction": _induction, "ioi": functools.partial(_ioi, executor=executor)}
        fns[args.method](sm, args, report)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"wrote the report to {args.report}")
    return 0


def torch_threads():
    text = os.environ.get("STEERKIT_THREADS")
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(f"expected $STEERKIT_THREADS as an integer >= 1, found {text!r}; unset it or fix it")
        torch.set_num_threads(n)


def _temporal(sm: "SteerModel", args, report):
    if args.source is not None and not 0 <= args.source < sm.n_layers - 1:
        raise InputError(f"expected --source in 0..{sm.n_layers - 2} (a later layer must exist), found {args.source}")
    if args.n_pairs < 2:
        raise InputError(f"expected --n-pairs >= 2, found {args.n_pairs}")
    cfg = TemporalConfig(n_pairs=args.n_pairs, eval=args.eval, n_dev=args.n_dev, betas=_floats(args.betas, "--betas"),
                         seed=args.seed, source=args.source)
    res = REGISTRY["temporal"].run(sm, cfg, progress=not args.quiet)
    report.update(res.to_json())
    prof, src = res.profile, res.source
    peak = prof.peak_layer
    print(f"temporal divergence on {sm.name} ({prof.n_pairs} pairs): peak layer {peak}, rel[peak] "
          f"{prof.rel[peak]:.4f} +- {prof.rel_std[peak]:.4f}")
    print("  rel: " + " ".join(f"{x:.3f}" for x in prof.rel))
    print("  cos: " + " ".join(f"{x:.4f}" for x in prof.cos))
    if res.note:
        print(f"  note: the peak is the last layer, with no later layer to inject into; using the peak among "
              f"the earlier layers, {src}")
    if res.eval is not None:
        ev = res.eval
        beta = ev["beta"]
        for k, r in (("no injection", ev["base"]), (f"fixed tau, beta={beta}", ev["fixed_tau"]),
                     (f"per-input tau, beta={beta}", ev["per_input_tau"])):
            print(f"  {k:28s} acc {r['accuracy']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (n={r['n']})")
    _save(sm, args, res)


def _norms(sm: "SteerModel", args, report):
    prompts = tuple(read_prompts(args.prompts)) if args.prompts else None
    cfg = NormsConfig(prompts=prompts, drift_tokens=args.drift_tokens, window=args.window, passes=args.passes)
    res = REGISTRY["norms"].run(sm, cfg, progress=not args.quiet)
    report.update(res.to_json())
    prof = res.profile
    print(f"residual norms on {sm.name} ({prof.n_tokens} tokens, {res.n_prompts} prompts)")
    for l in range(prof.n_layers):
        print(f"  layer {l:2d}  mean {prof.mean[l]:9.2f}  std {prof.std[l]:9.2f}  w/o first {prof.mean_no_first[l]:8.2f}"
              f"  first {prof.first[l]:9.2f}")
    if res.chain is not None:
        chain = res.chain
        L = chain.n_layers
        ends = ", ".join(f"{chain.norms[(p + 1) * L - 1]:.1f}" for p in range(chain.passes))
        print(f"re-applied blocks ({chain.passes} passes x {L} blocks): norm (w/o first token) at the end of each "
              f"pass {ends}; growth per extra pass {[round(float(g), 2) for g in chain.growth_per_pass]}")
    if res.drift is not None:
        d = res.drift
        print(f"attention mass during generation ({d.n_steps} steps, recent window {d.window}; first -> last step):")
        for l in sorted({0, d.n_layers // 3, (2 * d.n_layers) // 3, d.n_layers - 1}):
            parts = "  ".join(f"{k} {getattr(d, k)[l, 0]:.2f}->{getattr(d, k)[l, -1]:.2f}"
                              for k in ("sink", "prompt", "recent", "generated"))
            print(f"  layer {l:2d}  {parts}  ||h|| {d.norm[l, 0]:.1f}->{d.norm[l, -1]:.1f}")
    if args.html:
        _write_html(args.html, res.figures())


def _mi(sm: "SteerModel", args, report):
    words = tuple(w for w in args.thinking_words.split(",") if w) if args.thinking_words else None
    cfg = MIConfig(data=args.data, n=args.n, layer=args.layer, max_new_tokens=args.max_new_tokens, k=args.k,
                   eval=args.eval, n_eval=args.n_eval, recycle_layer=args.recycle_layer, thinking_words=words,
                   continue_with=args.continue_with, eval_tokens=args.eval_tokens)
    res = REGISTRY["mi-peaks"].run(sm, cfg, progress=not args.quiet)
    report.update(res.to_json())
    for tr in res.trajectories:
        print(f"  layer {res.layer}: {len(tr.mi)} steps, MI mean {tr.mi.mean():.3f} max {tr.mi.max():.3f}; "
              f"peaks at {tr.peaks} tokens {tr.peak_tokens}")
    print(f"tokens at MI peaks over {len(res.trajectories)} questions: {report['peak_tokens']}")
    ev = res.thinking_eval
    if ev is not None:
        print(f"{args.eval} problems (n={ev['n']}), recycling at block {ev['layer']} on {ev['thinking_tokens']} "
              f"({ev['recycled_steps']} recycled steps):")
        for cond in ("greedy", "recycling", "continuation"):
            if cond in ev:
                r = ev[cond]
                print(f"  {cond:<13} accuracy {r['accuracy']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]  "
                      f"({r['correct']}/{ev['n']}), mean tokens {r['tokens_mean']:.1f}")


def _caa(sm: "SteerModel", args, report):
    cfg = CAAConfig(layers=_layers(args.layers, sm.n_layers),
                    multipliers=_floats(args.multipliers, "--multipliers"))
    res = REGISTRY["caa"].run(sm, cfg, progress=not args.quiet)
    report.update(res.to_json())
    print(f"CAA on {sm.name} ({res.n_items} A/B items, myopic reward; in-sample)")
    for l in res.layers:
        print(f"  layer {l:2d}: " + "  ".join(f"x{r['multiplier']:+.0f}: {r['p_matching']:.3f}" for r in res.rows
                                            if r["layer"] == l))
    _save(sm, args, res)


_REGION_ARGS = ("data", "level", "n_train", "n_test", "layer", "n_components", "n_clusters", "strength",
                "max_new_tokens", "train_max_new_tokens", "keep", "min_kept", "seed")


def _region(sm: "SteerModel", args, report):
    if args.n_train < 2 or args.n_test < 0:
        raise InputError(f"expected --n-train >= 2 and --n-test >= 0, found {args.n_train} and {args.n_test}")
    if args.data != "arith" and args.n_train + args.n_test > 300:
        raise InputError(f"expected --n-train + --n-test <= 300 (the vendored GSM8K problems), found "
                         f"{args.n_train + args.n_test}")
    cfg = RegionConfig(**{k: getattr(args, k) for k in _REGION_ARGS}, batch_size=args.batch_size)
    res = REGISTRY["region"].run(sm, cfg, progress=not args.quiet)
    d = res.to_json()
    report["region"] = {**d, "args": {k: getattr(args, k) for k in _REGION_ARGS}}
    fit = d["fit"]
    print(f"concise region on {sm.name}, layer {res.layer} ({args.data}, {res.n_train} training problems)")
    for s in ("verbose", "concise"):
        t = d["train"][s]
        print(f"  {s:8s} solutions: acc {t['accuracy']:.3f}, {t['tokens_mean']:.1f} tokens; kept "
              f"{d['n_' + s + '_kept']} ({d['selection'][s]}), {d['n_points'][s]} boundary points")
    print(f"  fit: {fit['n_components']} PCA dims ({fit['explained_variance']:.2f} of the variance), "
          f"{fit['n_clusters']} half-spaces; inside: concise {fit['concise_inside']:.2f}, verbose {fit['verbose_inside']:.2f}")
    if d["eval"]:
        ev = d["eval"]
        for k in ("baseline", "projected"):
            r = ev[k]
            print(f"  {k:9s} tokens {r['tokens_mean']:6.1f} [{r['tokens_ci95'][0]:.1f}, {r['tokens_ci95'][1]:.1f}]  "
                  f"acc {r['accuracy']:.3f} [{r['accuracy_ci95'][0]:.3f}, {r['accuracy_ci95'][1]:.3f}]  "
                  f"finished {r['finished']:.2f}  (n={r['n']})")
        pdiff = ev["paired_token_diff"]
        print(f"  projected - baseline tokens: {pdiff['mean']:+.1f} [{pdiff['ci95'][0]:+.1f}, {pdiff['ci95'][1]:+.1f}] "
              f"(paired, bootstrap 95%)")
    _save(sm, args, res)


def _critique(sm: "SteerModel", args, report):
    n_eval = args.n if args.n_eval is None else args.n_eval
    if args.n < 1 or n_eval < 2:
        raise InputError(f"expected --n >= 1 and --n-eval >= 2, found {args.n} and {n_eval}")
    layers = "all" if args.layers == "all" else _layers(args.layers, sm.n_layers)
    cfg = CritiqueConfig(n=args.n, n_eval=args.n_eval, layers=layers, alphas=_floats(args.alphas, "--alphas"),
                         contrast=args.contrast, min_recoveries=args.min_recoveries, layer=args.layer,
                         batch_size=args.batch_size, seed=args.seed)
    swept = cfg.swept_layers(sm.n_layers)
    if args.layer is not None and args.layer not in swept:
        raise InputError(f"expected --layer among the swept layers {swept}, found {args.layer}")
    res = REGISTRY["critique"].run(sm, cfg, progress=not args.quiet)
    d = res.to_json()
    report["critique"] = {**d, "args": {k: getattr(args, k) for k in ("n", "n_eval", "layers", "alphas", "contrast",
                                                                        "min_recoveries", "layer", "seed")}}
    print(f"hidden critique vector on {sm.name}: {res.n_train} training questions, contrast {res.contrast} "
          f"({res.n_pos} vs {res.n_neg} traces; {res.n_recovered} recoveries)")
    base = res.baseline()
    if base is not None:
        print(f"  unsteered: F1 {base['f1']:.3f} (acc erroneous {base['acc_error']:.3f}, correct "
              f"{base['acc_correct']:.3f}; n={base['n_error']}+{base['n_correct']})")
    for l in res.layers:
        print(f"  layer {l:2d} |v| {res.norms[l]:7.2f}: " + "  ".join(
            f"{r['alpha']:+.1f}: {r['f1']:.2f}" for r in res.rows if r["layer"] == l))
    for l in res.layers:
        print(f"  lens {l:2d} top: " + " ".join(repr(t) for t, _ in res.lens.get(l, {}).get("top", [])[:8]))
    if not args.no_save:
        store = _store(args)
        (name, sv), = res.artifacts(sm).items()
        print(f"saved {store.save(name, sv)} (layer {d['saved_layer']}) to {store.root}")


def _induction(sm: "SteerModel", args, report):
    layers = _layers(args.layers, sm.n_layers)
    cfg = induction_method.InductionConfig(n_seqs=args.n_seqs, seq_len=args.seq_len, seed=args.seed, layers=layers,
                                           batch_size=args.batch_size, top_k=args.top_k)
    res = REGISTRY["induction"].run(sm, cfg, progress=not args.quiet)
    report["induction"] = res.to_json()
    print(f"induction heads on {sm.name} ({res.n_seqs} random sequences of {res.seq_len} tokens, repeated once)")
    for line in induction_method.summary_lines(res):
        print("  " + line)
    if args.html:
        _write_html(args.html, res.figures())


def _ioi(sm: "SteerModel", args, report, executor=None):
    cfg = ioi_method.IOIConfig(templates=ioi_method.TEMPLATES[:args.n_templates],
                               names=ioi_method.NAMES[:args.n_names], hooks=_hooks_arg(args.hooks),
                               batch_size=args.batch_size)
    res = REGISTRY["ioi"].run(sm, cfg, progress=not args.quiet, executor=executor)
    report["ioi"] = res.to_json()
    print(f"IOI activation patching on {sm.name} ({len(cfg.templates)} templates x {len(cfg.names)} name pairs)")
    for line in ioi_method.summary_lines(res):
        print("  " + line)
    if args.html:
        _write_html(args.html, res.figures())
