"""``steerkit temporal | norms | mi-peaks | caa | region | critique``: published methods on a model (default: the embedded
SmolLM2-135M-Instruct), with progress on stderr, a JSON report (``--report``) and artifacts saved to
the vector store (``--out``, default ``$STEERKIT_STORE`` or ``./steerkit-store``; ``--no-save``).

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
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

_DEFAULT_PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain photosynthesis briefly.",
                    "List three prime numbers.", "How do I boil an egg?", "Tell me a joke about cats."]


def register(subparsers) -> None:
    def common(p):
        p.add_argument("--model", default=None, help="model folder, .gguf or cached hub id (default: embedded "
                       "SmolLM2-135M-Instruct)")
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
    p.add_argument("--layers", default=None, help="comma-separated layers to evaluate (default: every 3rd)")
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


def _log(args, *a):
    if not args.quiet:
        print(*a, file=sys.stderr)


def _store(args):
    from steerkit.vectors import Store
    return Store(args.out) if args.out else Store()


def run(args) -> int:
    from steerkit import load_model
    torch_threads()
    sm = load_model(args.model)
    report = {"model": sm.name}
    fn = {"temporal": _temporal, "norms": _norms, "mi-peaks": _mi, "caa": _caa, "region": _region,
          "critique": _critique}[args.method]
    fn(sm, args, report)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"wrote the report to {args.report}")
    return 0


def torch_threads():
    import os
    import torch
    if os.environ.get("STEERKIT_THREADS"):
        torch.set_num_threads(int(os.environ["STEERKIT_THREADS"]))


def _bar(args, total, desc):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=args.quiet)


def _temporal(sm, args, report):
    from steerkit.errors import InputError
    from steerkit.probes import temporal as T
    from steerkit.vectors import SteeringVector
    if args.n_pairs < 2:
        raise InputError(f"expected --n-pairs >= 2, found {args.n_pairs}")
    pairs = T.temporal_pairs(args.n_pairs, seed=args.seed)
    with _bar(args, 2 * len(pairs), "temporal profile") as bar:
        prof = T.temporal_profile(sm, pairs, progress=bar.update)
    report["profile"] = prof.to_dict()
    src = prof.peak_layer
    print(f"temporal divergence on {sm.name} ({len(pairs)} pairs): peak layer {src}, rel[peak] "
          f"{prof.rel[src]:.4f} +- {prof.rel_std[src]:.4f}")
    print("  rel: " + " ".join(f"{x:.3f}" for x in prof.rel))
    print("  cos: " + " ".join(f"{x:.4f}" for x in prof.cos))
    if args.source is not None:
        if not 0 <= args.source < sm.n_layers - 1:
            raise InputError(f"expected --source in 0..{sm.n_layers - 2} (a later layer must exist), found {args.source}")
        src = args.source
    elif src == sm.n_layers - 1:
        src = int(prof.rel[:-1].argmax())
        print(f"  note: the peak is the last layer, with no later layer to inject into; using the peak among "
              f"the earlier layers, {src}")
        report["note"] = f"peak is the last layer; source {src} = argmax over layers < {sm.n_layers - 1}"
    report["source_layer"] = src
    sched = prof.schedule(src)
    if args.eval:
        items = T.order_questions(args.n_dev + args.eval, seed=args.seed + 1)
        dev, test = items[: args.n_dev], items[args.n_dev:]
        betas = [float(b) for b in args.betas.split(",")]
        tau = prof.tau[src]
        beta, rows = T.choose_beta(sm, dev, tau, sched, betas)
        base = T.choice_accuracy(sm, test)
        fixed = T.choice_accuracy(sm, test, steering=T.injection_spec(tau, sched, beta))

        def per_input(batch):
            taus = T.per_input_taus(sm, [it.prompt for it in batch], [it.prompt_rev for it in batch], src)
            return [T.injection_spec(t, sched, beta) for t in taus]
        per = T.choice_accuracy(sm, test, steering=per_input)
        report["eval"] = {"dev_rows": rows, "beta": beta, "base": base, "fixed_tau": fixed, "per_input_tau": per}
        for k, r in (("no injection", base), (f"fixed tau, beta={beta}", fixed), (f"per-input tau, beta={beta}", per)):
            print(f"  {k:28s} acc {r['accuracy']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (n={r['n']})")
    if not args.no_save:
        store = _store(args)
        sv = SteeringVector.from_direction(prof.tau[src], list(sched.weights), sm, method="temporal-injection",
                                           metrics={"source_layer": src, "rel": [float(x) for x in prof.rel]})
        sv.schedule = sched
        refs = [store.save("temporal-tau", sv), store.save("temporal-schedule", sched)]
        print(f"saved {', '.join(refs)} to {store.root}")


def _norms(sm, args, report):
    from steerkit.cli._common import read_prompts
    from steerkit.probes.norms import attention_drift, norm_chain, norm_profile
    prompts = read_prompts(args.prompts) if args.prompts else _DEFAULT_PROMPTS
    with _bar(args, 1, "norms") as bar:
        prof = norm_profile(sm, prompts)
        bar.update(1)
    report["norms"] = prof.to_dict()
    print(f"residual norms on {sm.name} ({prof.n_tokens} tokens, {len(prompts)} prompts)")
    for l in range(prof.n_layers):
        print(f"  layer {l:2d}  mean {prof.mean[l]:9.2f}  std {prof.std[l]:9.2f}  w/o first {prof.mean_no_first[l]:8.2f}"
              f"  first {prof.first[l]:9.2f}")
    figs = [prof.plot()]
    if args.passes > 1:
        chain = norm_chain(sm, prompts, passes=args.passes)
        report["chain"] = chain.to_dict()
        figs.append(chain.plot())
        L = chain.n_layers
        ends = ", ".join(f"{chain.norms[(p + 1) * L - 1]:.1f}" for p in range(chain.passes))
        print(f"re-applied blocks ({chain.passes} passes x {L} blocks): norm (w/o first token) at the end of each "
              f"pass {ends}; growth per extra pass {[round(float(g), 2) for g in chain.growth_per_pass]}")
    if args.drift_tokens > 0:
        with _bar(args, 1, "attention drift") as bar:
            d = attention_drift(sm, prompts, max_new_tokens=args.drift_tokens, window=args.window)
            bar.update(1)
        report["drift"] = d.to_dict()
        figs.append(d.plot())
        print(f"attention mass during generation ({d.n_steps} steps, recent window {d.window}; first -> last step):")
        for l in sorted({0, d.n_layers // 3, (2 * d.n_layers) // 3, d.n_layers - 1}):
            parts = "  ".join(f"{k} {getattr(d, k)[l, 0]:.2f}->{getattr(d, k)[l, -1]:.2f}"
                              for k in ("sink", "prompt", "recent", "generated"))
            print(f"  layer {l:2d}  {parts}  ||h|| {d.norm[l, 0]:.1f}->{d.norm[l, -1]:.1f}")
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            for i, fig in enumerate(figs):
                f.write(fig.to_html(full_html=i == 0, include_plotlyjs="cdn" if i == 0 else False))
        print(f"wrote the figures to {args.html}")


def _mi(sm, args, report):
    from steerkit.datafiles import read_jsonl
    from steerkit.probes.mi import mi_trajectory, peak_token_counts
    rows = read_jsonl("reasoning/gsm8k_test_first300.jsonl", path=args.data, n=args.n, what="question/answer rows")
    layer = args.layer if args.layer is not None else (2 * sm.n_layers) // 3
    out, trs = [], []
    with _bar(args, len(rows), "mi-peaks") as bar:
        for r in rows:
            q, a = r.get("question") or r.get("prompt"), r.get("answer") or r.get("solution")
            tr = mi_trajectory(sm, q, a, layer, max_new_tokens=args.max_new_tokens, k=args.k)
            out.append(tr.to_dict())
            bar.update(1)
            print(f"  layer {layer}: {len(tr.mi)} steps, MI mean {tr.mi.mean():.3f} max {tr.mi.max():.3f}; "
                  f"peaks at {tr.peaks} tokens {tr.peak_tokens}")
            trs.append(tr)
    report["mi"] = out
    report["peak_tokens"] = peak_token_counts(trs)
    print(f"tokens at MI peaks over {len(trs)} questions: {report['peak_tokens']}")
    if args.eval:
        from steerkit.probes import region as RG
        from steerkit.probes.mi import THINKING_WORDS, thinking_eval
        probs = (RG.arithmetic_problems(args.n_eval, seed=1) if args.eval == "arith"
                 else RG.gsm8k_problems(args.n_eval))
        words = [w for w in args.thinking_words.split(",") if w] if args.thinking_words else THINKING_WORDS
        rl = args.recycle_layer if args.recycle_layer is not None else layer
        bs = 8
        steps = -(-len(probs) // bs) * (3 if args.continue_with else 2)
        with _bar(args, steps, "thinking eval") as bar:
            ev = thinking_eval(sm, probs, layer=rl, words=words, continue_with=args.continue_with or None,
                               max_new_tokens=args.eval_tokens, batch_size=bs, progress=bar.update)
        report["thinking_eval"] = ev
        print(f"{args.eval} problems (n={ev['n']}), recycling at block {ev['layer']} on {ev['thinking_tokens']} "
              f"({ev['recycled_steps']} recycled steps):")
        for cond in ("greedy", "recycling", "continuation"):
            if cond in ev:
                r = ev[cond]
                print(f"  {cond:<13} accuracy {r['accuracy']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]  "
                      f"({r['correct']}/{ev['n']}), mean tokens {r['tokens_mean']:.1f}")


def _caa(sm, args, report):
    from steerkit.probes import caa as C
    from steerkit.vectors import SteeringVector
    items = C.AB_ITEMS
    with _bar(args, 1, "caa vector") as bar:
        v = C.caa_vector(sm, items)
        bar.update(1)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(0, sm.n_layers, 3))
    mults = [float(x) for x in args.multipliers.split(",")]
    rows = C.caa_eval(sm, v, items, layers, mults)
    report["caa"] = {"rows": rows, "norms": [float(x) for x in v.norm(dim=-1)]}
    print(f"CAA on {sm.name} ({len(items)} A/B items, myopic reward; in-sample)")
    for l in layers:
        print(f"  layer {l:2d}: " + "  ".join(f"x{r['multiplier']:+.0f}: {r['p_matching']:.3f}" for r in rows
                                            if r["layer"] == l))
    if not args.no_save:
        store = _store(args)
        sv = SteeringVector({l: v[l] for l in range(sm.n_layers)}, provenance=SteeringVector.from_direction(
            v[0], 0, sm, method="caa").provenance)
        print(f"saved {store.save('caa-vector', sv)} to {store.root}")


def _region(sm, args, report):
    from steerkit.errors import InputError
    from steerkit.probes import region as R
    if args.n_train < 2 or args.n_test < 0:
        raise InputError(f"expected --n-train >= 2 and --n-test >= 0, found {args.n_train} and {args.n_test}")
    if args.data != "arith" and args.n_train + args.n_test > 300:
        raise InputError(f"expected --n-train + --n-test <= 300 (the vendored GSM8K problems), found "
                         f"{args.n_train + args.n_test}")

    def problems(n, seed, offset, exclude=()):
        if n == 0:
            return []
        n_g = {"arith": 0, "gsm8k": n, "mix": n // 2}[args.data]
        out = R.gsm8k_problems(n_g, offset=offset) if n_g else []
        return out + R.arithmetic_problems(n - n_g, seed=seed, level=args.level, exclude=exclude)
    train = problems(args.n_train, args.seed, 0)
    test = problems(args.n_test, args.seed + 1, 300 - args.n_test, exclude=[p.question for p in train])
    total = 2 * len(train) + 2 * len(test)
    with _bar(args, total, "region") as bar:
        res = R.run_region(sm, train, test, layer=args.layer, n_components=args.n_components,
                           n_clusters=args.n_clusters, strength=args.strength, max_new_tokens=args.max_new_tokens,
                           train_max_new_tokens=args.train_max_new_tokens, batch_size=args.batch_size,
                           seed=args.seed, keep=args.keep, min_kept=args.min_kept, progress=bar.update)
    d = res.to_dict()
    report["region"] = {**d, "args": {k: getattr(args, k) for k in ("data", "level", "n_train", "n_test", "layer",
                                                                      "n_components", "n_clusters", "strength",
                                                                      "max_new_tokens", "train_max_new_tokens",
                                                                      "keep", "min_kept", "seed")}}
    fit = d["fit"]
    print(f"concise region on {sm.name}, layer {res.layer} ({args.data}, {len(train)} training problems)")
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
    if not args.no_save:
        store = _store(args)
        reg = res.region
        if d["eval"]:
            ev = d["eval"]
            reg.provenance.metrics["eval"] = {k: ev[k] for k in ("baseline", "projected", "paired_token_diff")}
        print(f"saved {store.save('region-concise', reg)} to {store.root}")


def _critique(sm, args, report):
    from steerkit.errors import InputError
    from steerkit.probes import critique as K
    n_eval = args.n if args.n_eval is None else args.n_eval
    if args.n < 1 or n_eval < 2:
        raise InputError(f"expected --n >= 1 and --n-eval >= 2, found {args.n} and {n_eval}")
    try:
        alphas = [float(x) for x in args.alphas.split(",") if x.strip()]
        layers = (list(range(sm.n_layers)) if args.layers == "all" else
                  [int(x) for x in args.layers.split(",") if x.strip()] if args.layers else
                  sorted(set(range(0, sm.n_layers, 5)) | {sm.n_layers - 1}))
    except ValueError as e:
        raise InputError(f"expected comma-separated numbers in --alphas / --layers, found {e}") from None
    if args.layer is not None and args.layer not in layers:
        raise InputError(f"expected --layer among the swept layers {layers}, found {args.layer}")
    total = 2 * args.n + len(layers) * len(alphas)  # traces recorded, then one step per (layer, alpha) row
    with _bar(args, total, "critique") as bar:
        res = K.run_critique(sm, args.n, n_eval=n_eval, layers=layers, alphas=alphas, contrast=args.contrast,
                             min_recoveries=args.min_recoveries, seed=args.seed, batch_size=args.batch_size,
                             progress=bar.update)
    d = res.to_dict()
    report["critique"] = {**d, "args": {k: getattr(args, k) for k in ("n", "n_eval", "layers", "alphas", "contrast",
                                                                        "min_recoveries", "layer", "seed")}}
    print(f"hidden critique vector on {sm.name}: {res.n_train} training questions, contrast {res.contrast} "
          f"({res.n_pos} vs {res.n_neg} traces; {res.n_recovered} recoveries)")
    base = res.baseline()
    if base is not None:
        print(f"  unsteered: F1 {base['f1']:.3f} (acc erroneous {base['acc_error']:.3f}, correct "
              f"{base['acc_correct']:.3f}; n={base['n_error']}+{base['n_correct']})")
    for l in layers:
        print(f"  layer {l:2d} |v| {res.norms[l]:7.2f}: " + "  ".join(
            f"{r['alpha']:+.1f}: {r['f1']:.2f}" for r in res.rows if r["layer"] == l))
    for l in layers:
        print(f"  lens {l:2d} top: " + " ".join(repr(t) for t, _ in res.lens.get(l, {}).get("top", [])[:8]))
    best = res.best()
    layer = args.layer if args.layer is not None else best["layer"]
    report["critique"]["saved_layer"] = layer
    if not args.no_save:
        store = _store(args)
        sv = K.to_artifact(sm, res, layer, seed=args.seed)
        print(f"saved {store.save('critique-vector', sv)} (layer {layer}) to {store.root}")
