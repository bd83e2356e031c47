"""``steerkit probe ...``: fit a probe into the store, score prompts with it, sweep layers x positions.

Wiring: :func:`steerkit.cli.build_parser` imports this module, calls :func:`register` with its
sub-parsers object, and runs :func:`run` for the ``probe`` command.

* ``steerkit probe fit --pos POS --neg NEG --layer L [--position P] --name NAME`` records the two
  prompt sets at ``blocks.L.hook_<site>`` and position ``P`` (default ``last``), fits the probe
  (``--method logistic|diffmean|pca_diff|pca_center``), cross-validates that one cell (AUROC with
  its bootstrap interval, balanced accuracy) into the artifact's metrics, and saves a
  :class:`~steerkit.vectors.Probe` to the store (``--store``, ``$STEERKIT_STORE`` or
  ``./steerkit-store``) and/or a file (``--output x.safetensors``). Prints the reference.
* ``steerkit probe score PROBE --prompts FILE [--label-key KEY] [--json]``: ``PROBE`` is a store
  reference (``name``, ``name@2``, ``name@tag``) or an artifact file; ``FILE`` is ``.json`` (a
  list of strings or of objects with ``prompt``/``instruction``/``text``/``question``),
  ``.jsonl`` (one such object per line) or text (one prompt per line). Prints one score (logit;
  higher = the probe's positive class) per prompt, and the AUROC when labels are present
  (``--label-key``, or a ``label`` field on every record). Labels may be 0/1, booleans,
  ``pos``/``neg``/``positive``/``negative`` or the probe's class names.
* ``steerkit probe sweep --pos POS --neg NEG [--hooks resid_post:all] [--positions last,mean,-2]
  [--method logistic,diffmean] [--out table.csv|.json|.html]`` prints the tidy table and the best cell.

Exit codes: 0 success, 2 bad input or a missing/mismatched artifact, printed as one line
``steerkit: error: ...`` (the message says what was expected, what was found and what to do).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from steerkit.cli._common import (add_model_options, check_min, check_output_path, check_store_path, load_model_from,
                                  parse_hooks, read_prompts, read_records, resolve_hooks, run_group)
from steerkit.errors import InputError
from steerkit.hooks.names import BLOCK_HOOKS
from steerkit.probes import (auroc, fit_probe, labels_for, record_activations, score_prompts, sweep,
                             sweep_activations)
from steerkit.probes.scoring import probe_position
from steerkit.probes.sweep import NAMED_POSITIONS as READ_POSITIONS
from steerkit.vectors import Probe, Store, load_artifact, save_artifact
from steerkit.vectors.safety import check_name

_TRUE = {"1", "true", "yes", "pos", "positive"}
PROBE_METHODS = ("logistic", "diffmean", "pca_diff", "pca_center")
_FALSE = {"0", "false", "no", "neg", "negative"}


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("probe", help="fit, score and sweep linear probes",
                              description="Fit linear probes into the artifact store, score prompts with them, "
                                          "and sweep layers x positions.")
    sub = p.add_subparsers(dest="probe_cmd", metavar="VERB")
    sub.required = True

    def common(sp):
        add_model_options(sp, backend=True)
        sp.add_argument("--store", default=None, help="store folder (default: $STEERKIT_STORE or ./steerkit-store)")
        sp.add_argument("--batch-size", type=int, default=16)

    f = sub.add_parser("fit", help="fit a probe on two prompt sets and save it")
    common(f)
    f.add_argument("--pos", required=True, help="prompts of the positive class (.json, .jsonl or text)")
    f.add_argument("--neg", required=True, help="prompts of the negative class")
    f.add_argument("--layer", type=int, required=True, help="0-based block index")
    f.add_argument("--position", default="last",
                   help="last | mean | first_generated | an index among prompt tokens (-1 = last)")
    f.add_argument("--hook-site", default="resid_post", help="resid_post (default), resid_pre, resid_mid, ...")
    f.add_argument("--method", default="logistic", help="logistic | diffmean | pca_diff | pca_center")
    f.add_argument("--name", default=None, help="store under this name (a new version)")
    f.add_argument("--tag", action="append", default=[], help="tag the new version (repeatable)")
    f.add_argument("-o", "--output", default=None, help="also (or only) write the artifact to this file")
    f.add_argument("--pos-name", default="positive", help="class name of --pos (default: positive)")
    f.add_argument("--neg-name", default="negative", help="class name of --neg (default: negative)")
    f.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    f.add_argument("--folds", type=int, default=5, help="CV folds for the stored metrics (0: skip CV)")
    f.add_argument("--json", action="store_true", help="machine-readable output")

    s = sub.add_parser("score", help="score prompts with a stored probe (AUROC when labels are given)")
    common(s)
    s.add_argument("probe", help="store reference (name, name@N, name@tag) or an artifact file")
    s.add_argument("--prompts", required=True, help="prompts file (.json list, .jsonl, or one per line)")
    s.add_argument("--label-key", default=None, help="field holding the label (default: 'label' when every "
                   "record has one)")
    s.add_argument("--json", action="store_true", help="print one machine-readable JSON object")

    w = sub.add_parser("sweep", help="cross-validate every layer x position (x method) on two prompt sets")
    common(w)
    w.add_argument("--pos", required=True)
    w.add_argument("--neg", required=True)
    w.add_argument("--hooks", default="resid_post:all", help="e.g. resid_post:all, resid_pre:10-14")
    w.add_argument("--positions", default="last",
                   help="comma-separated: last, mean, first_generated, or token indices")
    w.add_argument("--method", default="logistic", help="comma-separated methods")
    w.add_argument("--folds", type=int, default=5)
    w.add_argument("--n-boot", type=int, default=500)
    w.add_argument("--no-chat", action="store_true")
    w.add_argument("--out", default=None, help="save the table (.csv/.json) or the plot (.html)")
    w.add_argument("--json", action="store_true")

    p.set_defaults(func=run)
    return p


# --------------------------------------------------------------------------- helpers
def _position(text: str):
    t = text.strip()
    if t in READ_POSITIONS:
        return t
    try:
        return int(t)
    except ValueError:
        raise InputError(f"expected a position among {', '.join(READ_POSITIONS)} or an integer, found {text!r:.80}"
                         ) from None


def _hook_site(text: str) -> str:
    site = text if text.startswith("hook_") else f"hook_{text}"
    if site not in BLOCK_HOOKS:
        raise InputError(f"expected a hook site in {[h[5:] for h in BLOCK_HOOKS]}, found {text!r}")
    return site


def _label(v, classes: list[str], where: str) -> int:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)) and v in (0, 1):
        return int(v)
    if isinstance(v, str):
        t = v.strip().lower()
        if len(classes) == 2 and t == classes[1].lower():
            return 1
        if len(classes) == 2 and t == classes[0].lower():
            return 0
        if t in _TRUE:
            return 1
        if t in _FALSE:
            return 0
    raise InputError(f"expected a label 0/1, true/false, pos/neg or one of the probe's classes {classes} at "
                     f"{where}, found {v!r}")


def _load_probe(ref: str, store_dir: str | None):
    path = Path(ref)
    if not path.exists() and (path.suffix or "/" in ref or os.sep in ref):
        raise InputError(f"expected a probe artifact file at {ref}, found nothing there; check the path, or pass "
                         "the store name of a probe saved with 'steerkit probe fit' (name, name@N, name@tag)")
    art = load_artifact(ref, store=Store(store_dir) if store_dir else None)
    if not isinstance(art, Probe):
        raise InputError(f"expected a probe artifact at {ref!r}, found a {getattr(art, 'kind', type(art).__name__)}; "
                         "pass the name of a probe saved with 'steerkit probe fit'")
    return art


def _common_checks(args) -> None:
    """What every probe verb can refuse before a model loads."""
    check_store_path(args.store)
    check_min(args.batch_size, "--batch-size", 1)


def _folds(n: int, zero_ok: bool) -> None:
    if not (n == 0 and zero_ok) and n < 2:
        raise InputError(f"expected --folds >= 2{' (or 0 to skip cross-validation)' if zero_ok else ''}, found {n}")


def _fmt(x) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


# --------------------------------------------------------------------------- verbs
def cmd_fit(args) -> int:
    if not args.name and not args.output:
        raise InputError("expected --name (save to the store) and/or --output FILE, found neither")
    if args.method not in PROBE_METHODS:
        raise InputError(f"expected --method logistic, diffmean, pca_diff or pca_center, found {args.method!r}")
    _common_checks(args)
    if args.name:
        check_name(args.name, "--name")
    for t in args.tag:
        check_name(t, "--tag")
    check_min(args.layer, "--layer", 0, "layers are 0-based block indices")
    _folds(args.folds, zero_ok=True)
    if args.output:
        check_output_path(args.output, "--output")
    pos, neg = read_prompts(args.pos), read_prompts(args.neg)
    position = _position(args.position)
    site = _hook_site(args.hook_site)
    sm = load_model_from(args)
    hook = f"blocks.{args.layer}.{site}"
    sm.hooks.parse(hook)
    chat = not args.no_chat
    prompts = pos + neg
    acts = record_activations(sm, prompts, hooks=[hook], positions=[position], chat=chat,
                              batch_size=args.batch_size)
    X = next(iter(acts.values()))  # [1, n, d]
    y = [1] * len(pos) + [0] * len(neg)
    metrics = {}
    if args.folds:
        r = sweep_activations(X, y, method=args.method, layers=[args.layer], hooks=[hook], n_folds=args.folds)
        metrics = {f"cv_{k}": r.rows[0][k] for k in ("auroc", "auroc_ci_low", "auroc_ci_high", "balanced_accuracy")}
        metrics["cv_folds"] = args.folds
    probe = fit_probe(X[0], labels=y, layer=args.layer, method=args.method, model=sm, hook_site=site,
                      classes=[args.neg_name, args.pos_name], position=position, chat=chat, prompts=prompts,
                      metrics=metrics)
    out = {"layer": args.layer, "position": position, "hook": hook, "method": args.method,
           "n_pos": len(pos), "n_neg": len(neg), **metrics}
    if args.name:
        out["ref"] = (Store(args.store) if args.store else Store()).save(args.name, probe, tags=args.tag)
    if args.output:
        out["file"] = str(save_artifact(probe, args.output))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        where = " and ".join(x for x in (out.get("ref"), out.get("file")) if x)
        cv = (f"; {args.folds}-fold CV AUROC {_fmt(metrics['cv_auroc'])} [{_fmt(metrics['cv_auroc_ci_low'])}, "
              f"{_fmt(metrics['cv_auroc_ci_high'])}], balanced accuracy {_fmt(metrics['cv_balanced_accuracy'])}"
              if metrics else "")
        print(f"saved {args.method} probe at {hook}, position {position} ({len(pos)} pos / {len(neg)} neg) "
              f"as {where}{cv}")
    return 0


def cmd_score(args) -> int:
    _common_checks(args)
    probe = _load_probe(args.probe, args.store)
    records = read_records(args.prompts)
    key = args.label_key
    if key is None and all("label" in r for r in records):
        key = "label"
    labels = None
    if key is not None:
        missing = [i for i, r in enumerate(records) if key not in r]
        if missing:
            raise InputError(f"expected a {key!r} field on every record of {args.prompts}, found it missing at "
                             f"records {missing[:10]}")
        labels = [_label(r[key], probe.classes, f"{args.prompts} record {i}") for i, r in enumerate(records)]
    sm = load_model_from(args)
    scores = score_prompts(sm, probe, [r["prompt"] for r in records], batch_size=args.batch_size)
    au = None
    n_pos = 0
    if labels is not None:
        if len(set(labels)) < 2:
            raise InputError(f"expected both classes among the labels to compute an AUROC, found only "
                             f"{labels[0]}; add prompts of the other class or drop --label-key")
        au = auroc(np.asarray(labels), scores)
        n_pos = sum(labels)
    logistic = probe.probe_kind == "logistic"
    rows = []
    for i, (r, s) in enumerate(zip(records, scores)):
        row = {"index": i, "prompt": r["prompt"], "score": float(s)}
        if logistic:
            row["probability"] = 1.0 / (1.0 + math.exp(-float(s))) if s > -700 else 0.0
        if labels is not None:
            row["label"] = labels[i]
        rows.append(row)
    info = {"probe": args.probe, "kind": probe.probe_kind, "layer": probe.layer, "hook_site": probe.hook_site,
            "position": probe_position(probe), "classes": probe.classes, "n": len(rows), "auroc": au,
            "label_key": key, "scores": rows}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    pos_name = probe.classes[-1] if probe.classes else "positive"
    print(f"probe {args.probe}: {probe.probe_kind} at blocks.{probe.layer}.{probe.hook_site}, position "
          f"{info['position']}; score = logit of {pos_name!r}")
    head = f"{'#':>4} {'score':>9}" + (f" {'p':>6}" if logistic else "") + (" label" if labels else "") + "  prompt"
    print(head)
    for row in rows:
        text = row["prompt"].replace("\n", " ")
        text = text if len(text) <= 70 else text[:67] + "..."
        print(f"{row['index']:>4} {row['score']:>9.4f}" + (f" {row['probability']:6.3f}" if logistic else "")
              + (f" {row['label']:>5}" if labels else "") + f"  {text}")
    if au is not None:
        print(f"AUROC {au:.4f} (n={len(rows)}, {n_pos} labelled {pos_name!r})")
    return 0


def cmd_sweep(args) -> int:
    if args.out:
        check_output_path(args.out, "--out")
    parsed_hooks = parse_hooks(args.hooks)
    positions = [_position(x) for x in args.positions.split(",") if x.strip()]
    if not positions:
        raise InputError(f"expected at least one position in --positions, found {args.positions!r}")
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    bad = [m for m in methods if m not in PROBE_METHODS]
    if bad or not methods:
        raise InputError(f"expected --method as comma-separated names among {', '.join(PROBE_METHODS)}, found "
                         f"{args.method!r}")
    _common_checks(args)
    _folds(args.folds, zero_ok=False)
    check_min(args.n_boot, "--n-boot", 1)
    pos, neg = read_prompts(args.pos), read_prompts(args.neg)
    sm = load_model_from(args)
    hooks = resolve_hooks(parsed_hooks, sm.n_layers)
    res = sweep(sm, *labels_for(pos, neg), hooks=hooks, positions=positions, method=methods, n_folds=args.folds,
                n_boot=args.n_boot, chat=not args.no_chat, batch_size=args.batch_size)
    if args.out:
        res.save(args.out)
    if args.json:
        print(json.dumps({"meta": res.meta, "rows": res.rows, "best": res.best()}, indent=1, default=str))
        return 0
    print(res.table())
    b = res.best()
    print(f"best: layer {b['layer']}, position {b['position']}, {b['method']}: AUROC {b['auroc']:.3f} "
          f"[{b['auroc_ci_low']:.3f}, {b['auroc_ci_high']:.3f}]" + (f"; saved {args.out}" if args.out else ""))
    return 0


def run(args: argparse.Namespace) -> int:
    return {"fit": cmd_fit, "score": cmd_score, "sweep": cmd_sweep}[args.probe_cmd](args)


def main(argv: list[str] | None = None) -> int:
    """``steerkit probe ARGV...`` (``python -m steerkit.cli.probes``)."""
    return run_group(register, "probe", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
