"""``steerkit vectors ...``: list, show, export, import, tag, search and remove stored artifacts.

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

from steerkit.cli._common import check_output_path, check_store_path, run_group
from steerkit.errors import InputError
from steerkit.vectors import ARTIFACT_KINDS, Store, export, import_artifact


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
    ex.add_argument("--format", "-f", required=True, choices=["llama.cpp", "repeng", "easysteer", "tlens", "svec", "safetensors"])
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
    else:  # pragma: no cover - argparse restricts the choices
        raise InputError(f"expected a vectors verb (list, show, export, import, tag, search, rm), found {cmd!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``steerkit vectors ARGV...`` (``python -m steerkit.cli.vectors``)."""
    return run_group(register, "vectors", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
