"""Recording on a Ray cluster (``steerkit.executors.RayExecutor``, ``steerkit record --ray``), exactly once.

A local Ray cluster of this machine (2 CPUs) runs the workers; each loads the default model once with one
torch thread, as the single-process reference here does, and the batch boundaries are the same on both
sides, so the datasets are compared bit for bit. Checked: the Ray dataset equals the single-process one;
killing a worker mid-run still gives the identical dataset (its shard runs again elsewhere, written once);
killing the driver and running the same command again records only the shards not yet committed, leaving
the committed ones untouched.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'steerkit[ray]')")

from steerkit.executors import ModelSpec, RayExecutor  # noqa: E402
from steerkit.storage.dataset import record_dataset  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ["blocks.2.hook_resid_post", "blocks.9.hook_resid_pre"]
WORDS = ["cats", "rain", "tea", "maps", "code", "ships", "bread", "stars"]
PROMPTS = [f"A short note, number {i}, about {w} and why they matter" for i, w in enumerate(WORDS * 6)]
SHARD, BATCH = 3, 2


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module: its address (other processes join it)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="steerkit")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(default_model, tmp_path_factory):
    """The single-process dataset, one torch thread, the same batches and shards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return record_dataset(default_model, PROMPTS, HOOKS, tmp_path_factory.mktemp("ref"), batch_size=BATCH,
                              shard_size=SHARD, progress=False)
    finally:
        torch.set_num_threads(threads)


def same(ds, ref) -> None:
    assert len(ds) == len(ref) == len(PROMPTS)
    for h in HOOKS:
        got, want = ds.load(h), ref.load(h)
        assert got.shape == want.shape and torch.equal(got, want), h


def manifest_shards(out: Path) -> dict:
    try:
        return json.loads((out / "manifest.json").read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return {}


def test_ray_dataset_equals_the_single_process_one(cluster, reference, tmp_path):
    with RayExecutor(ModelSpec(threads=1), workers=2) as ex:
        ds = record_dataset(None, PROMPTS, HOOKS, tmp_path / "ray", batch_size=BATCH, shard_size=SHARD,
                            progress=False, executor=ex)
        assert ex.fingerprint == reference.meta["fingerprint"]
    same(ds, reference)
    assert ds.meta["fingerprint"] == reference.meta["fingerprint"]


def test_a_killed_worker_changes_nothing(cluster, reference, tmp_path):
    out = tmp_path / "killed"
    ex = RayExecutor(ModelSpec(threads=1), workers=2)
    ex._start()
    result: dict = {}

    def run():
        try:
            result["ds"] = record_dataset(None, PROMPTS, HOOKS, out, batch_size=BATCH, shard_size=SHARD,
                                          progress=False, executor=ex)
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 300
    while not manifest_shards(out) and time.time() < deadline:
        time.sleep(0.02)
    victim = ex.actors[0]
    ray.kill(victim)  # mid-run: shards are still to come
    t.join(600)
    ex.close()
    assert "error" not in result, result.get("error")
    n_shards = -(-len(PROMPTS) // SHARD)
    assert len(manifest_shards(out)) == n_shards
    assert ex.replacements_left == 1  # the dead worker was replaced once
    same(result["ds"], reference)


def _cli(out: Path, address: str, prompts: Path) -> list[str]:
    return [sys.executable, "-m", "steerkit", "record", str(prompts), "-o", str(out), "--ray", address,
            "--workers", "1", "--hooks", ",".join(HOOKS), "--batch-size", str(BATCH), "--shard-size", str(SHARD),
            "--no-chat", "--device", "cpu", "--dtype", "float32", "--quiet"]


def test_a_killed_driver_resumes_with_the_missing_shards_only(cluster, reference, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "driver"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.Popen(_cli(out, cluster, prompts), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while len(manifest_shards(out)) < 2 and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    n_shards = -(-len(PROMPTS) // SHARD)
    first = manifest_shards(out)
    assert 2 <= len(first) < n_shards, f"expected the driver killed mid-run, found {len(first)} of {n_shards} shards"
    stamps = {f: (out / f).stat().st_mtime_ns for f in first}
    r = subprocess.run(_cli(out, cluster, prompts), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(PROMPTS)} prompts" in r.stdout
    assert len(manifest_shards(out)) == n_shards
    assert {f: (out / f).stat().st_mtime_ns for f in first} == stamps  # committed shards were not rewritten
    assert not [f for f in os.listdir(out) if ".tmp-" in f]
    from steerkit.storage.dataset import ActivationDataset
    same(ActivationDataset(out), reference)


def test_ray_is_optional_and_not_imported_without_it():
    code = ("import sys, steerkit, steerkit.cli, steerkit.storage.dataset, steerkit.executors; "
            "print('ray' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face folder, which every worker loads."""
    try:
        from tiny_models import tiny_model
    except ImportError:  # pragma: no cover
        from tests.tiny_models import tiny_model
    model, tok = tiny_model("llama")
    folder = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_searches_on_ray_select_what_they_select_here(cluster, tiny_folder):
    """The tuning grid, the refusal search and a patching grid spread over two workers equal the local runs."""
    import steerkit
    from steerkit.probes.methods import refusal as R
    from steerkit.probes import tune
    try:
        import test_executors as X
    except ImportError:  # pragma: no cover
        from tests import test_executors as X
    sm = steerkit.load_model(tiny_folder, device="cpu", dtype="float32")
    with RayExecutor(ModelSpec(str(tiny_folder), device="cpu", dtype="float32", threads=1), workers=2) as ex:
        args, kw = X.tune_args(sm)
        X.same_tune(tune(sm, *args, executor=ex, **kw), tune(sm, *args, **kw))
        rargs = X.refusal_args(sm)
        local = R.select_direction(*rargs, prune_frac=0.0)
        spread = R.select_direction(*rargs, prune_frac=0.0, executor=ex)
        from steerkit.probes import activation_patching, logit_diff_metric
        clean, corrupted, metric = [5, 17, 23, 40, 41, 7], [5, 17, 29, 40, 41, 7], logit_diff_metric(sm, 12, 13)
        grid = activation_patching(sm, clean, corrupted, metric, progress=False, executor=ex)
        assert torch.allclose(grid.values, activation_patching(sm, clean, corrupted, metric, progress=False).values,
                              atol=1e-5, rtol=0)
        assert ex.fingerprint == sm.fingerprint()
    assert (spread.best.pos, spread.best.layer, spread.rule) == (local.best.pos, local.best.layer, local.rule)
