"""Render the help of every ``steerkit`` subcommand (from ``steerkit.cli.build_parser()``) as Markdown.

    .venv/bin/python scripts/cli_reference.py           # writes docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check   # exits 1 if docs/cli.md differs from the parser

The documentation build (``mkdocs build``, through ``docs/hooks/docs_build.py``) runs the same check, so
the page always matches the parser. Help text is wrapped at a fixed width, whatever the terminal.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from steerkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "cli.md"
WIDTH = 100

HEADER = """# CLI reference

Every subcommand of `steerkit` with its `--help`, generated from `steerkit.cli.build_parser()` by
`scripts/cli_reference.py` (run it after changing a command; `mkdocs build` fails while this page
differs from the parser). Any error a command reports on purpose prints one line and exits with status 2.
"""


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    cls = parser.formatter_class
    parser.formatter_class = lambda prog, cls=cls: cls(prog, width=WIDTH, max_help_position=30)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.extend(action.choices.items())
    return out


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for name, sub in _subcommands(parser):
        yield from _walk(sub, path + [name])


def top_level_verbs() -> list[str]:
    """The first-level subcommands of ``steerkit``, in the parser's order."""
    return [name for name, _ in _subcommands(build_parser())]


def render() -> str:
    """The Markdown page: one section per command and subcommand, each with its help in a code block."""
    parts = [HEADER]
    for path, parser in _walk(build_parser(), ["steerkit"]):
        _fixed_width(parser)
        level = "#" * min(len(path) + 1, 4)
        parts.append(f"\n{level} `{' '.join(path)}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write docs/cli.md from steerkit's argument parser.")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is not current; write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} differs from steerkit.cli.build_parser(); "
                  f"run: .venv/bin/python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
