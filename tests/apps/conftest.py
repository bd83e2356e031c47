"""The app tests' shared fixtures: folders of saved results (with FIFOs, device files, links and escapes planted),
the app on the tiny model over them, and a test client."""
from __future__ import annotations

import json
import os

import pytest

from dash_requests import PORT

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sec")
    results, store, cache, outside = root / "results", root / "store", root / "cache", root / "outside"
    for d in (results, outside):
        d.mkdir()
    (results / "sub").mkdir()
    good = {"name": "good", "layers": [0, 1], "positions": ["last"], "auroc": [[0.6], [0.9]]}
    (results / "sub" / "good_sweep.json").write_text(json.dumps(good))
    (results / "mi_good.json").write_text(json.dumps({"mi": [0.1, 0.5, 0.2]}))
    os.mkfifo(results / "fifo_sweep.json")
    os.mkfifo(results / "mi_fifo.json")
    os.symlink("/dev/zero", results / "zero_sweep.json")
    os.symlink("/dev/zero", results / "mi_zero.json")
    (outside / "secret_sweep.json").write_text(json.dumps(good))
    (outside / "mi_secret.json").write_text(json.dumps({"mi": [0.3, 0.1]}))
    os.symlink(outside / "secret_sweep.json", results / "link_sweep.json")
    os.symlink(outside, results / "linkdir")
    return {"root": root, "results": results, "store": store, "cache": cache, "outside": outside}


@pytest.fixture(scope="module")
def app(tiny, folders):
    from steerkit.apps.app import create_app
    a = create_app(tiny, store=str(folders["store"]), results=str(folders["results"]),
                   cache_dir=str(folders["cache"]), port=PORT, deadline=30.0)
    return a


@pytest.fixture()
def client(app):
    return app.server.test_client()
