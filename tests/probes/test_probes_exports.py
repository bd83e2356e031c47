"""steerkit.probes exports its general tools (at most 100 names); the published methods' names live in
steerkit.probes.methods and their modules, load only when asked for, and their old names under steerkit.probes
warn with the new place."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import steerkit.probes as probes

ROOT = Path(__file__).resolve().parents[2]
MOVED = sorted((name, module) for module, names in probes.METHOD_NAMES.items() for name in names)


def test_the_probes_export_at_most_100_general_names():
    assert len(probes.__all__) <= 100
    assert len(set(probes.__all__)) == len(probes.__all__)
    for name in probes.__all__:
        obj = getattr(probes, name)  # no warning: a general tool
        module = getattr(obj, "__module__", "") or ""
        assert not module.startswith("steerkit.probes.methods"), f"{name} is a published method's ({module})"


def test_no_method_name_is_exported_as_a_general_tool():
    assert set(probes.__all__).isdisjoint(name for name, _ in MOVED)


@pytest.mark.parametrize("name,module", MOVED)
def test_a_moved_name_warns_with_its_new_place_and_is_the_same_object(name, module):
    new = importlib.import_module(f"steerkit.probes.methods.{module}")
    with pytest.warns(DeprecationWarning, match=f"steerkit.probes.{name} is now steerkit.probes.methods.{module}.{name}"):
        old = getattr(probes, name)
    assert old is getattr(new, name)


def test_from_import_of_a_method_name_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match="steerkit.probes.methods.caa.caa_vector"):
        from steerkit.probes import caa_vector
    from steerkit.probes.methods.caa import caa_vector as new
    assert caa_vector is new


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        probes.no_such_tool  # noqa: B018


def test_importing_the_probes_loads_no_method():
    """A fresh process: ``import steerkit.probes`` (and every general tool) leaves the methods unloaded, the
    refusal method included; ``steerkit.probes.methods`` loads them on first use, without a warning."""
    code = ("import sys, warnings\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "import steerkit.probes\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('steerkit.probes.methods'))\n"
            "print('steerkit.probes.methods.refusal' in sys.modules, loaded)\n"
            "print(steerkit.probes.methods.REGISTRY['refusal'].name, 'steerkit.probes.methods.refusal' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:2] == ["False []", "refusal True"], r.stdout
