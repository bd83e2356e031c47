"""``steerkit refusal``: the refusal direction (Arditi et al. 2024) and the first-token refusal probe.

Builds a :class:`steerkit.probes.methods.refusal.RefusalConfig` from the flags and runs the
registry's ``refusal`` method (:func:`steerkit.probes.methods.refusal.run`) on a model (the embedded
default when none is given) with progress bars, prints a summary table, and saves the result's
artifacts into the vector store at ``--out``
(default ``$STEERKIT_STORE`` or ``./steerkit-store``):

* ``refusal-direction``: a ``SteeringVector`` (the unnormalised difference of means, added at
  ``blocks.{layer}.hook_resid_pre``; its metrics in the provenance),
* ``refusal-ablation``: a ``DirectionSet`` (the unit direction, ablated everywhere),
* ``refusal-probe``: the harmful-vs-harmless logistic probe; its position (the first generated token or a
  post-instruction template token, the last prompt token among them) and layer are chosen by
  cross-validation on its own train split (every vendored train prompt by default; the vendored val
  prompts are its held-out set), and its provenance records the position it reads.

``--report FILE`` writes every number (candidate table, rates, samples, the probe's CV and held-out
AUROC at every position x layer) as JSON;
``--orthogonalized DIR`` writes a Hugging Face model folder with the direction folded into the
weights (load it with ``steerkit.load_model(DIR)``).
``--ray [ADDRESS]`` scores the candidate directions on Ray workers that each load the model
(:mod:`steerkit.executors`); the rest runs here, on this process's copy.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from steerkit import cli as _cli
from steerkit.cli._common import (add_model_options, add_ray_options, check_min, check_output_path, check_store_path,
                                  model_with_workers, ray_executor)
from steerkit.errors import InputError
from steerkit.probes.methods import REGISTRY
from steerkit.probes.methods.refusal import RefusalConfig, save_orthogonalized
from steerkit.vectors import Store


def register(subparsers) -> None:
    p = subparsers.add_parser("refusal", help="find, select and save the refusal direction and the first-token "
                              "refusal probe (Arditi et al. 2024)")
    add_model_options(p)
    p.add_argument("--out", default=None, help="vector store folder (default: $STEERKIT_STORE or ./steerkit-store)")
    p.add_argument("--n-train", type=int, default=32, help="train prompts per side (default 32)")
    p.add_argument("--n-val", type=int, default=16, help="validation prompts per side, for selection (default 16)")
    p.add_argument("--n-test", type=int, default=16, help="held-out test prompts per side, for the reported "
                   "rates and probe AUROC (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--refusal-words", default="I,As", help="comma-separated refusal-start words (default I,As)")
    p.add_argument("--min-keep", type=int, default=8, help="filter a side only if at least this many remain")
    p.add_argument("--kl-max", type=float, default=0.1, help="discard candidates whose KL under ablation exceeds this")
    p.add_argument("--induce-min", type=float, default=0.0, help="discard candidates whose induce score (absolute "
                   "refusal score of harmless prompts under addition) is below this (paper: 0)")
    p.add_argument("--no-fallback", action="store_true", help="fail when no candidate passes the paper's induce "
                   "rule instead of selecting with the relaxed rule induce > baseline (the default fallback)")
    p.add_argument("--exhaustive", action="store_true", help="score induce/KL for every candidate (slower; "
                   "the default lazy search selects the same direction)")
    p.add_argument("--positions", type=int, default=None, metavar="K", help="candidates at the last K "
                   "post-instruction positions only (default: all, as the paper)")
    p.add_argument("--layer-step", type=int, default=1, metavar="S", help="candidates at every S-th layer only "
                   "(default 1: every layer, as the paper)")
    p.add_argument("--no-probe", action="store_true", help="skip the refusal probe")
    p.add_argument("--probe-n-train", type=int, default=None, metavar="N", help="refusal probe train prompts per "
                   "side (default: every vendored train prompt, 260 harmful + 1000 harmless)")
    p.add_argument("--probe-n-test", type=int, default=None, metavar="N", help="refusal probe held-out prompts "
                   "per side (default: every vendored val prompt, 39 harmful + 200 harmless)")
    p.add_argument("--one-at-a-time", action="store_true", help="score one candidate per forward pass instead "
                   "of many (per-row steering); selects the same direction")
    p.add_argument("--score-rows", type=int, default=None, metavar="N", help="rows per forward pass of the "
                   "batched candidate search (default: --batch-size on a CPU, 256 on a GPU)")
    p.add_argument("--orthogonalized", default=None, metavar="DIR", help="also write a weight-orthogonalised model")
    p.add_argument("--report", default=None, metavar="FILE", help="write all metrics as JSON")
    p.add_argument("--no-save", action="store_true", help="do not write to the store")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_ray_options(p, work="score the candidate directions (bypass, induce, KL; every candidate, as "
                    "--exhaustive)", here="this process loads the model too: it records the candidates, "
                    "evaluates the selected direction, fits the probe and writes the results")
    p.set_defaults(func=run)


def run(args) -> int:
    for k in ("n_train", "n_val", "n_test", "batch_size", "layer_step"):
        if getattr(args, k) < 1:
            raise InputError(f"expected --{k.replace('_', '-')} >= 1, found {getattr(args, k)}")
    check_min(args.max_new_tokens, "--max-new-tokens", 1)
    check_min(args.min_keep, "--min-keep", 0)
    check_min(args.positions, "--positions", 1, "K is how many post-instruction positions to try")
    check_min(args.probe_n_train, "--probe-n-train", 5, "5-fold cross-validation needs 5 prompts per side")
    check_min(args.probe_n_test, "--probe-n-test", 1)
    check_min(args.score_rows, "--score-rows", 1)
    check_store_path(args.out, "--out")
    if args.report:
        check_output_path(args.report, "--report")
    words = tuple(w for w in args.refusal_words.split(",") if w)
    if not words:
        raise InputError(f"expected comma-separated refusal-start words in --refusal-words, found "
                         f"{args.refusal_words!r}")
    cfg = RefusalConfig(n_train=args.n_train, n_val=args.n_val, n_test=args.n_test, seed=args.seed,
                        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, refusal_words=words,
                        min_keep=args.min_keep, kl_max=args.kl_max, induce_min=args.induce_min, lazy=not args.exhaustive,
                        fallback=None if args.no_fallback else "relative",
                        probe=not args.no_probe, n_positions=args.positions, layer_step=args.layer_step,
                        probe_n_train=args.probe_n_train, probe_n_test=args.probe_n_test,
                        batched=not args.one_at_a_time, score_rows=args.score_rows)
    if args.orthogonalized:  # fail now, not after the run
        o = Path(args.orthogonalized).expanduser()
        if o.exists():
            raise InputError(f"expected --orthogonalized to name a folder that does not exist yet, found {o}; "
                             "choose another path or remove it")
    executor = ray_executor(args) if args.ray is not None else None
    with model_with_workers(args, executor) as sm:
        res = REGISTRY["refusal"].run(sm, cfg, progress=not args.quiet, executor=executor)
    rows = res.summary_rows()
    if res.probe is not None:
        b = res.probe.best
        tok = res.probe.positions.get(b["position"], {}).get("token", "")
        rows.append((f"probe (harmful vs harmless) at {b['position']} ({tok!r})",
                     f"layer {b['layer']}: train CV AUROC {b['cv_auroc']:.3f}, held-out AUROC {b['test_auroc']:.3f} "
                     f"[{b['test_ci'][0]:.3f}, {b['test_ci'][1]:.3f}] on {b['n_test_pos']} + {b['n_test_neg']} "
                     "held-out prompts"))
    w = max(len(k) for k, _ in rows)
    print(f"refusal direction on {sm.name}")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    for n in res.notes + (res.probe.notes if res.probe is not None else []):
        print(f"  note: {n}")
    if not args.no_save:
        store = Store(args.out) if args.out else Store()
        refs = [store.save(name, art) for name, art in res.artifacts(sm).items()]
        print(f"saved {', '.join(refs)} to {store.root}")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(res.to_json(), f, indent=1)
        print(f"wrote the report to {args.report}")
    if args.orthogonalized:
        out = save_orthogonalized(sm, res.selection.direction, args.orthogonalized)
        print(f"wrote the weight-orthogonalised model to {out}")
    return 0


def main(argv=None) -> int:
    return _cli.main(["refusal", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    sys.exit(main())
