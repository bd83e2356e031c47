"""docs/hook_names.md's table agrees with steerkit's hook-name parser (``steerkit.hooks.names.parse``): every
name in its "steerkit" column is accepted (an SAE's sub-sites while an SAE is attached at their site, and only then), every TransformerLens name of a row whose steerkit column is "none"
is refused with ``HookNameError``, and every kind of site steerkit has appears in the table."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from steerkit.errors import HookNameError
from steerkit.hooks.names import BLOCK_HOOKS, COMPONENT_HOOKS, FINAL_HOOKS, MOE_HOOKS, SAE_HOOKS, parse

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "hook_names.md"
N_LAYERS = 4


def table_rows() -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in PAGE.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and not re.fullmatch(r"[|\s:-]+", line)]
    assert rows and rows[0][:2] == ["steerkit", "TransformerLens"], "expected the table's header first"
    return rows[1:]


def names_in(cell: str) -> list[str]:
    """The hook names written in code in a cell (a parenthesised remark, e.g. the bridge's aliases, left out),
    with ``{l}`` as block 1."""
    main = re.sub(r"\(.*?\)", "", cell)
    return [n.replace("{l}", "1") for n in re.findall(r"`([^`]+)`", main)]


def test_table_has_both_kinds_of_row():
    rows = table_rows()
    assert sum(r[0] == "none" for r in rows) >= 6
    assert sum(r[0] != "none" for r in rows) >= 15


@pytest.mark.parametrize("row", [r for r in table_rows() if r[0] != "none"], ids=lambda r: r[0])
def test_steerkit_names_are_accepted(row):
    names = names_in(row[0])
    assert names, f"no hook name in {row[0]!r}"
    for name in names:
        host = name.split(".hook_sae_")[0] if ".hook_sae_" in name else None
        site = parse(name, N_LAYERS, sae_sites=[host] if host else ())
        assert site.name == name
        if host:  # an SAE's sub-site exists only while one is attached there
            assert site.parent == host
            with pytest.raises(HookNameError, match="attach_sae"):
                parse(name, N_LAYERS)


@pytest.mark.parametrize("row", [r for r in table_rows() if r[0] == "none"], ids=lambda r: r[1])
def test_absent_names_are_refused(row):
    names = names_in(row[1])
    assert names, f"no TransformerLens name in {row[1]!r}"
    for name in names:
        with pytest.raises(HookNameError):
            parse(name, N_LAYERS)


def test_every_site_kind_is_in_the_table():
    listed = {n for r in table_rows() if r[0] != "none" for n in names_in(r[0])}
    hosts = [n.split(".hook_sae_")[0] for n in listed if ".hook_sae_" in n]
    kinds = {parse(n, N_LAYERS, sae_sites=hosts).kind for n in listed}
    missing = set(BLOCK_HOOKS + COMPONENT_HOOKS + MOE_HOOKS + FINAL_HOOKS + SAE_HOOKS) - kinds
    assert not missing, f"add these sites to docs/hook_names.md: {sorted(missing)}"
