"""Recording runs a model, so it lives above the model and the executors (steerkit.recording); the storage
below keeps the file format. The old names under steerkit.storage.dataset still work and warn with the new place."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import steerkit.recording as recording
import steerkit.storage.dataset as dataset
from steerkit.executors import LocalExecutor, RayExecutor


@pytest.mark.parametrize("name", ["record_dataset", "record_shard", "is_sparse_hook", "SPARSE_KINDS"])
def test_old_names_warn_with_the_new_place_and_are_the_same_objects(name):
    with pytest.warns(DeprecationWarning, match=f"steerkit.storage.dataset.{name} is now steerkit.recording.{name}"):
        old = getattr(dataset, name)
    assert old is getattr(recording, name)


def test_from_import_of_an_old_name_works():
    with pytest.warns(DeprecationWarning, match="steerkit.recording.record_dataset"):
        from steerkit.storage.dataset import record_dataset
    assert record_dataset is recording.record_dataset


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError):
        dataset.no_such_name  # noqa: B018
    assert not hasattr(dataset, "__wrapped__")


def test_the_storage_keeps_the_format_and_imports_nothing_above_it():
    """storage.dataset's imports (module level and under TYPE_CHECKING): none of the model, the executors, the
    hooks or the recording; the format, the writer and the reader stay there."""
    tree = ast.parse(Path(dataset.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    above = ("steerkit.executors", "steerkit.model", "steerkit.hooks", "steerkit.recording")
    assert sorted(m for m in imported if m.startswith(above)) == []
    assert callable(dataset.write_shards) and callable(dataset.resume_state) and dataset.FORMAT


def test_write_shards_moves_its_bar_by_where_results_come_from():
    assert LocalExecutor.in_process is True and RayExecutor.in_process is False
