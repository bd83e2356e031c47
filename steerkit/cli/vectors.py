"""``steerkit vectors ...``: list, show, export, import, tag, search and remove stored artifacts, and tune one
(``tune``: which layer and scale steer best, and what they break; :func:`steerkit.probes.tune`; ``--ray``
runs its grid's layers on Ray workers, :mod:`steerkit.executors`).

Wiring: the main CLI calls :func:`register` with its argparse sub-parsers object and, for the
``vectors`` command, :func:`run` with the parsed arguments (``args.func`` is also set to ``run``).
:func:`main` runs the sub-command on its own (``python -m steerkit.cli.vectors list``).

Exit codes: 0 success; 2 a steerkit error (unknown name, malformed file, a format that cannot
express the artifact...), printed on stderr as one line ``steerkit: error: ...``, or bad usage
(argparse); 1 an operating-system error (disk full, permission denied). The store is ``--store DIR``, else ``$STEERKIT_STORE``, else ``./steerkit-store``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from steerkit.cli._common import (add_model_options, add_ray_options, check_min, check_output_path,
                                  check_store_path, model_with_workers, ray_executor, read_prompts, run_group)
from steerkit.errors import InputError
from steerkit.hooks.names import parse_layers
from steerkit.probes.tune import Rule, tune
from steerkit.vectors import ARTIFACT_KINDS, DirectionSet, Probe, SteeringVector, Store, export, import_artifact


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("vectors", help="manage stored steering artifacts (list, show, export, import, rm)",
                              description="Manage the artifact store: list, show, export, import, tag, search, rm.")
    p.add_argument("--store", default=None, help="store folder (default: $STEERKIT_STORE or ./steerkit-store)")
    sub = p.add_subparsers(dest="vectors_cmd", metavar="VERB")
    sub.required = True

    ls = sub.add_parser("list", help="list artifacts (every version)")
    ls.add_argument("name", nargs="?", help="only this name")
    ls.add_argument("--latest", action="store_true", help="only the latest version of each name")
    ls.add_argument("--json", action="store_true", help="machine-readable output")

    sh = sub.add_parser("show", help="show one artifact version with its provenance")
    sh.add_argument("ref", help="NAME, NAME@N, NAME@latest or NAME@TAG")
    sh.add_argument("--json", action="store_true")

    ex = sub.add_parser("export", help="export an artifact for another engine")
    ex.add_argument("ref")
    ex.add_argument("--format", "-f", required=True, choices=["llama.cpp", "repeng", "easysteer", "easysteer-v1", "tlens", "svec", "safetensors"])
    ex.add_argument("-o", "--output", required=True, help="output file")
    ex.add_argument("--scale", type=float, default=None, help="multiply the vector (llama.cpp/repeng)")

    im = sub.add_parser("import", help="import a file (any supported format) into the store")
    im.add_argument("file")
    im.add_argument("--name", required=True, help="store under this name (a new version)")
    im.add_argument("--format", "-f", default=None, help="format (default: detect)")
    im.add_argument("--tag", action="append", default=[], help="tag the new version (repeatable)")

    tg = sub.add_parser("tag", help="point TAG at a version")
    tg.add_argument("ref")
    tg.add_argument("tag")

    se = sub.add_parser("search", help="search names, methods, models, kinds and tags")
    se.add_argument("text", nargs="?", default=None)
    se.add_argument("--kind", default=None)
    se.add_argument("--json", action="store_true")

    rm = sub.add_parser("rm", help="delete a version (NAME@N) or every version of NAME")
    rm.add_argument("ref")

    tu = sub.add_parser("tune", help="try a stored vector at several layers x scales: concept score and damage",
                        description="Steer prompts with a stored artifact at every layer x scale cell; score the "
                                    "concept (a stored probe or substrings) with a bootstrap interval, the damage "
                                    "(perplexity, next-token KL on neutral prompts, repetition), the Pareto front, "
                                    "and recommend a cell (steerkit.probes.tune).")
    tu.add_argument("ref", metavar="NAME", help="the artifact to tune: NAME, NAME@N or NAME@TAG (a steering vector "
                    "or a direction set)")
    tu.add_argument("--prompts", required=True, help="prompts to steer (.json list, .jsonl, or one per line)")
    tu.add_argument("--layers", default=None, help="grid layers: comma-separated ints and ranges, e.g. 6,10-14, or all "
                    "(default: the vector's own layers)")
    tu.add_argument("--scales", default="0,2,4,8", help="comma-separated strengths (default 0,2,4,8; negative "
                    "values as --scales=-4,0,4)")
    tu.add_argument("--neutral", default=None, help="prompts for the next-token KL (default: built-in neutral ones)")
    tu.add_argument("--concept-probe", default=None, metavar="NAME", help="a stored probe scores the concept")
    tu.add_argument("--contains", action="append", default=[], metavar="WORD",
                    help="a generation scores 1 when it contains one of these (repeatable)")
    tu.add_argument("--absent", action="append", default=[], metavar="WORD",
                    help="... and none of these (repeatable)")
    tu.add_argument("--tokens", type=int, default=32, help="new tokens per generation (default 32)")
    tu.add_argument("--normalize", default=None, choices=["unit", "resid"],
                    help="unit: scales are lengths; resid: fractions of the layer's mean residual norm")
    tu.add_argument("--max-kl", type=float, default=Rule.max_kl, help=f"rule: KL bound (default {Rule.max_kl})")
    tu.add_argument("--max-ppl-ratio", type=float, default=Rule.max_ppl_ratio,
                    help=f"rule: perplexity / baseline perplexity bound (default {Rule.max_ppl_ratio})")
    tu.add_argument("--max-repetition", type=float, default=Rule.max_repetition,
                    help=f"rule: bound on the share of degenerate generations (default {Rule.max_repetition})")
    tu.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples of the concept interval")
    tu.add_argument("--seed", type=int, default=0)
    tu.add_argument("--batch-size", type=int, default=64, help="rows per generate / forward call")
    add_model_options(tu, backend=True)
    tu.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    tu.add_argument("--json", action="store_true", help="print the whole result (with 'recommended') as JSON")
    tu.add_argument("--out", default=None, metavar="FILE.json", help="also save the result as JSON")
    tu.add_argument("--plot", default=None, metavar="FILE.html", help="also save the trade-off figure as HTML")
    add_ray_options(tu, work="run the grid's layers (each layer's cells with the unsteered baseline)",
                    here="this process loads the model too: it checks the vector against it and resolves the grid")

    p.set_defaults(func=run)
    return p


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(no artifacts)"
    cols = [("REF", "ref"), ("KIND", "kind"), ("TAGS", "tags"), ("MODEL", "model_name"), ("METHOD", "method"),
            ("D_MODEL", "d_model"), ("CREATED", "created_at")]
    cells = [[c for c, _ in cols]] + [[",".join(r.get(k) or []) if k == "tags" else str(r.get(k) if r.get(k) is not None else "-")
                                       for _, k in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    check_store_path(getattr(args, "store", None))
    store = Store(args.store) if getattr(args, "store", None) else Store()
    cmd = args.vectors_cmd
    if cmd == "list":
        rows = store.list(args.name, all_versions=not args.latest)
        print(json.dumps(rows, indent=1) if args.json else _table(rows), file=out)
    elif cmd == "show":
        info = store.show(args.ref)
        if args.json:
            print(json.dumps(info, indent=1), file=out)
        else:
            prov = info["meta"].get("provenance", {})
            print(f"{info['ref']}  ({info['meta'].get('kind')})  tags: {', '.join(info['tags']) or '-'}"
                  f"{'  [latest]' if info['latest'] else ''}", file=out)
            for k, v in info["meta"].get("fields", {}).items():
                print(f"  {k}: {v}", file=out)
            for k, v in prov.items():
                print(f"  provenance.{k}: {v}", file=out)
    elif cmd == "export":
        check_output_path(args.output, "--output")
        art = store.load(args.ref)
        paths = export(art, args.format, args.output, scale=args.scale)
        for p in paths:
            print(f"wrote {p}", file=out)
    elif cmd == "import":
        if not Path(args.file).is_file():
            raise InputError(f"expected an artifact file to import at {args.file}, found "
                             f"{'a folder' if Path(args.file).is_dir() else 'nothing'} there; check the path")
        art = import_artifact(args.file, args.format)
        ref = store.save(args.name, art, tags=args.tag)
        print(f"imported {args.file} as {ref}", file=out)
    elif cmd == "tag":
        print(f"{args.tag} -> {store.tag(args.ref, args.tag)}", file=out)
    elif cmd == "search":
        if args.kind is not None and args.kind not in ARTIFACT_KINDS:
            raise InputError(f"expected --kind among {', '.join(sorted(ARTIFACT_KINDS))}, found {args.kind!r}")
        rows = store.search(args.text, **({"kind": args.kind} if args.kind else {}))
        print(json.dumps(rows, indent=1) if args.json else _table(rows), file=out)
    elif cmd == "rm":
        for r in store.delete(args.ref):
            print(f"removed {r}", file=out)
    elif cmd == "tune":
        return _tune(args, store)
    else:  # pragma: no cover - argparse restricts the choices
        raise InputError(f"expected a vectors verb (list, show, export, import, tag, search, rm, tune), found {cmd!r}")
    return 0


def _float_list(spec: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"expected {flag} as comma-separated numbers (e.g. 0,2,4,8), found {spec!r}") from None


def _tune(args: argparse.Namespace, store: Store) -> int:
    """``steerkit vectors tune NAME --prompts FILE ...``: everything is checked before the model loads."""
    for path, flag in ((args.out, "--out"), (args.plot, "--plot")):
        if path is not None:
            check_output_path(path, flag)
    check_min(args.tokens, "--tokens", 1)
    check_min(args.batch_size, "--batch-size", 1)
    check_min(args.n_boot, "--n-boot", 1)
    layers = parse_layers(args.layers, what="--layers") if args.layers is not None else None
    scales = _float_list(args.scales, "--scales")
    if args.concept_probe is not None and (args.contains or args.absent):
        raise InputError("expected --concept-probe NAME or --contains/--absent WORD, found both; choose one")
    if args.concept_probe is None and not (args.contains or args.absent):
        raise InputError("expected a concept score: --concept-probe NAME (a stored probe) or --contains WORD "
                         "(repeatable, with optional --absent WORD), found neither")
    rule = Rule(max_kl=args.max_kl, max_ppl_ratio=args.max_ppl_ratio, max_repetition=args.max_repetition)
    executor = ray_executor(args) if args.ray is not None else None
    art = store.load(args.ref)
    if not isinstance(art, (SteeringVector, DirectionSet)):
        raise InputError(f"expected {args.ref} to be a steering vector or a direction set to tune, found a "
                         f"{getattr(art, 'kind', type(art).__name__)}")
    concept: object
    if args.concept_probe is not None:
        concept = store.load(args.concept_probe)
        if not isinstance(concept, Probe):
            raise InputError(f"expected --concept-probe {args.concept_probe} to be a probe, found a "
                             f"{getattr(concept, 'kind', type(concept).__name__)}")
    else:
        concept = {"contains": list(args.contains), "absent": list(args.absent)}
    prompts = read_prompts(args.prompts)
    neutral = read_prompts(args.neutral) if args.neutral is not None else None
    with model_with_workers(args, executor) as sm:
        if layers == "all":
            layers = parse_layers("all", sm.n_layers)
        res = tune(sm, art, prompts, layers=layers, scales=scales, concept=concept, neutral=neutral,
                   max_new_tokens=args.tokens, batch_size=args.batch_size, rule=rule, n_boot=args.n_boot,
                   seed=args.seed, normalize=args.normalize, chat=not args.no_chat, progress=sys.stderr.isatty(),
                   executor=executor)
    doc = res.to_json()
    doc["settings"]["artifact"] = f"{args.ref}: {doc['settings']['artifact']}"
    if args.out is not None:
        Path(args.out).write_text(json.dumps(doc, allow_nan=False), encoding="utf-8")
    if args.plot is not None:
        res.plot().write_html(args.plot, include_plotlyjs="cdn")
    if args.json:
        print(json.dumps(doc, indent=1, allow_nan=False))
        return 0
    print(_tune_table(doc))
    return 0


def _tune_table(doc: dict) -> str:
    def num(x, fmt=".3g"):
        return "-" if x is None else format(x, fmt)

    b = doc["baseline"]
    lines = [f"concept: {doc['settings'].get('concept', doc['concept_kind'])}",
             f"baseline: concept {num(b['concept'])} [{num(b['concept_ci'][0])}, {num(b['concept_ci'][1])}], "
             f"perplexity {num(b['perplexity'])}, repetition {num(b['repetition'], '.2f')}",
             f"{'layer':>5} {'scale':>7} {'concept':>8} {'95% CI':>17} {'ppl':>8} {'ppl x':>6} {'kl':>7} {'rep':>5}  front"]
    for c in doc["cells"]:
        ci = f"[{num(c['concept_ci'][0])}, {num(c['concept_ci'][1])}]"
        lines.append(f"{c['layer']:>5} {c['scale']:>7g} {num(c['concept']):>8} {ci:>17} {num(c['perplexity']):>8} "
                     f"{num(c['ppl_ratio']):>6} {num(c['kl']):>7} {num(c['repetition'], '.2f'):>5}  "
                     f"{'*' if c['pareto'] else ''}")
    rec, rule = doc["recommended"], doc["rule"]
    bounds = f"kl <= {rule['max_kl']}, ppl ratio <= {rule['max_ppl_ratio']}, repetition <= {rule['max_repetition']}"
    lines.append(f"recommended: layer {rec['layer']}, scale {rec['scale']:g} (highest {rule['objective']} with {bounds})"
                 if rec else f"recommended: none (no cell has {bounds}; loosen the bounds or lower the scales)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``steerkit vectors ARGV...`` (``python -m steerkit.cli.vectors``)."""
    return run_group(register, "vectors", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
