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
from steerkit.recording import record_dataset  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
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
def reference(default_model, scratch):
    """The single-process dataset, one torch thread, the same batches and shards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return record_dataset(default_model, PROMPTS, HOOKS, scratch("ref"), batch_size=BATCH,
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
    code = ("import sys, steerkit, steerkit.cli, steerkit.storage.dataset, steerkit.recording, steerkit.executors; "
            "print('ray' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.strip() == "False", r.stdout + r.stderr


@pytest.fixture(scope="module")
def tiny_folder(make_tiny_folder):
    """A tiny random Llama saved as a Hugging Face folder, which every worker loads."""
    return make_tiny_folder()


def test_searches_on_ray_select_what_they_select_here(cluster, tiny_folder):
    """The tuning grid, the refusal search and a patching grid spread over two workers equal the local runs."""
    import steerkit
    from steerkit.probes.methods import refusal as R
    from steerkit.probes import tune
    from tests.core import test_executors as X
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


@pytest.fixture(scope="module")
def chat_folder(scratch):
    """A tiny random Llama (4 layers, d_model 64) with the default model's tokenizer and chat template, saved as
    a Hugging Face folder: what the refusal method (post-instruction tokens) and IOI (one-token names) need."""
    from tiny_models import tiny_chat_llama
    model, tok = tiny_chat_llama()
    folder = scratch("tiny-chat") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def assert_close(got, want, where: str = "", tol: float = 1e-4) -> None:
    """JSON values equal: numbers within ``tol``, everything else exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}", tol)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]", tol)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=tol), where
    else:
        assert got == want, where


def test_search_verbs_with_ray_print_what_they_print_here(cluster, chat_folder, tmp_path, capsys, monkeypatch):
    """``steerkit refusal``, ``vectors tune`` and ``ioi`` with ``--ray`` (two workers on the cluster), in this
    process through the command line's main, against the same commands without it."""
    import steerkit
    from steerkit.cli import main
    from steerkit.vectors import SteeringVector, Store

    sent: list = []  # the pieces of work each --ray run handed to its workers
    imap = RayExecutor.imap_unordered

    def counted(self, fn, items):
        sent.append(len(items))
        return imap(self, fn, items)
    monkeypatch.setattr(RayExecutor, "imap_unordered", counted)

    def run(argv: list, out: Path, ray_on: bool) -> dict:
        capsys.readouterr()
        sent.clear()
        rc = main([str(a) for a in [*argv, *(["--ray", "--workers", "2"] if ray_on else [])]])
        printed = capsys.readouterr()
        assert rc == 0, printed.err
        assert bool(sent) == ray_on and all(sent), sent  # with --ray the search ran on the workers
        assert "refusal direction on" in printed.out or "recommended:" in printed.out or "IOI" in printed.out
        return json.loads(out.read_text())

    model = ["--model", chat_folder, "--device", "cpu", "--dtype", "float32"]
    # the refusal direction: the candidates scored on the workers, the same selection and held-out samples
    refusal = ["refusal", *model, "--n-train", "4", "--n-val", "2", "--n-test", "2", "--max-new-tokens", "4",
               "--min-keep", "1", "--positions", "2", "--no-probe", "--no-save", "--quiet", "--report"]
    here, there = (run([*refusal, tmp_path / f"refusal-{k}.json"], tmp_path / f"refusal-{k}.json", k == "ray")
                   for k in ("here", "ray"))
    lazy = {k: here["metrics"].pop(k) for k in ("n_evaluated_bypass", "n_evaluated_induce")}
    every = {k: there["metrics"].pop(k) for k in lazy}
    assert every["n_evaluated_induce"] >= lazy["n_evaluated_induce"]
    scored = [c for c in there["candidates"] if c["bypass"] is not None]  # layer 0: a zero vector, no score
    assert scored and all(c["induce"] is not None and c["kl"] is not None for c in scored)  # every one, all three
    for c_here, c_there in zip(here.pop("candidates"), there.pop("candidates"), strict=True):
        for k in ("pos", "layer", "bypass", "induce", "kl"):
            if c_here[k] is not None:  # the lazy search here computes only what it asks for
                assert_close(c_there[k], c_here[k], f"candidate {c_here['pos']}/{c_here['layer']} {k}")
    assert_close(there, here)  # selection, scores, held-out rates and samples

    # the tuning grid: each layer on a worker, the same generations, front and recommendation
    sm = steerkit.load_model(chat_folder, device="cpu", dtype="float32")
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(3))
    Store(tmp_path / "store").save("vec", SteeringVector.from_direction(v, 1, sm))
    (tmp_path / "p.txt").write_text("Tell me a joke\nWrite about the sea\nHi there\nExplain rain\n")
    tune = ["vectors", "--store", tmp_path / "store", "tune", "vec", *model, "--prompts", tmp_path / "p.txt",
            "--layers", "0-2", "--scales", "0,2,6", "--contains", "the", "--tokens", "5", "--n-boot", "50",
            "--no-chat", "--out"]
    here, there = (run([*tune, tmp_path / f"tune-{k}.json"], tmp_path / f"tune-{k}.json", k == "ray")
                   for k in ("here", "ray"))
    assert_close(there, here)

    # IOI: every patching grid's layers on the workers
    ioi = ["ioi", *model, "--n-templates", "1", "--n-names", "2", "--no-save", "--quiet", "--report"]
    here, there = (run([*ioi, tmp_path / f"ioi-{k}.json"], tmp_path / f"ioi-{k}.json", k == "ray")
                   for k in ("here", "ray"))
    assert_close(there, here)


def test_attribution_graphs_on_ray_equal_the_local_ones(cluster, tiny_folder, tmp_path):
    """Each prompt's pruned graph computed on two workers, which load the model and the transcoders (by path, not
    sent as tensors) once each, equals the one computed here; so do the recurring features."""
    import steerkit
    from steerkit.probes import CircuitSpec, attribution_graphs
    from tiny_models import random_transcoders
    sm = steerkit.load_model(tiny_folder, device="cpu", dtype="float32")
    tc = random_transcoders(sm, d_sae=48, seed=11, scale=3.0)
    path = tc.save(tmp_path / "tc.safetensors")
    prompts = ["Hello world, it is", "The cat sat on the", "Hello there, the cat", "A short note about rain"]
    options = dict(max_feature_nodes=40, batch_size=16, node_threshold=0.95)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = attribution_graphs(sm, tc, prompts, progress=False, **options)
    finally:
        torch.set_num_threads(threads)
    spec = CircuitSpec(ModelSpec(str(tiny_folder), device="cpu", dtype="float32", threads=1), str(path))
    with RayExecutor(spec, workers=2) as ex:
        spread = attribution_graphs(sm, tc, prompts, ex, progress=False, **options)
        assert ex.fingerprint == sm.fingerprint()
        held = ex.first(lambda state: (type(state).__name__, state.transcoders == tc))
    assert held == ("CircuitWorker", True)
    assert sum(len(g.features) for g in local.graphs) > 0
    for a, b in zip(spread.graphs, local.graphs, strict=True):
        assert torch.equal(a.nodes, b.nodes) and a.labels == b.labels and torch.equal(a.features, b.features)
        assert torch.allclose(a.adjacency, b.adjacency, atol=1e-6) and torch.allclose(a.influence, b.influence,
                                                                                      atol=1e-6)
        assert a.replacement_score == pytest.approx(b.replacement_score, abs=1e-6)
    assert [(f.layer, f.feature, f.n_prompts) for f in spread.features] == \
        [(f.layer, f.feature, f.n_prompts) for f in local.features]
    assert [f.mean_influence for f in spread.features] == pytest.approx([f.mean_influence for f in local.features])


def test_circuits_batch_with_ray_prints_what_it_prints_here(cluster, tiny_folder, tmp_path, capsys):
    """``steerkit circuits batch --ray`` (two workers on the cluster) against the same command without it."""
    import steerkit
    from steerkit.cli import main
    from tiny_models import random_transcoders
    sm = steerkit.load_model(tiny_folder, device="cpu", dtype="float32")
    random_transcoders(sm, d_sae=48, seed=11, scale=3.0).save(tmp_path / "tc.safetensors")
    (tmp_path / "p.txt").write_text("Hello world, it is\nThe cat sat on the\nHello there, the cat\n")
    argv = ["circuits", "batch", tmp_path / "p.txt", "--model", tiny_folder, "--device", "cpu", "--dtype", "float32",
            "--transcoders", tmp_path / "tc.safetensors", "--max-feature-nodes", "40", "--batch-size", "16",
            "--node-threshold", "0.95", "--quiet", "--json"]
    out = {}
    for k, extra in (("here", []), ("ray", ["--ray", "--workers", "2"])):
        capsys.readouterr()
        assert main([str(a) for a in [*argv, tmp_path / f"{k}.json", *extra]]) == 0
        out[k] = capsys.readouterr().out.replace(str(tmp_path / f"{k}.json"), "OUT")
    assert out["ray"] == out["here"] and "prompts, mean influence" in out["here"]
    here, there = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("here", "ray"))
    assert_close(there, here, tol=1e-5)
