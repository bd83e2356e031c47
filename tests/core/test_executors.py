"""Searches spread over an executor (``steerkit.executors``) give what they give in one process: the tuning
grid and the refusal candidate search, on a tiny model, through :class:`LocalExecutor` (the same split and
merge a Ray executor runs; ``tests/integration/test_ray.py`` runs them on a cluster)."""
from __future__ import annotations

import pytest
import torch

from steerkit.executors import LocalExecutor, ModelSpec, RayExecutor
from steerkit.errors import InputError
from steerkit.probes import tune
from steerkit.probes.methods import refusal as R


PROMPTS = ["Tell me a joke", "Write about the sea", "Hi there", "Explain rain"]


def tune_args(sm):
    v = torch.randn(sm.d_model, generator=torch.Generator().manual_seed(3))
    return (v, PROMPTS), dict(layers=[0, 1], scales=[0.0, 2.0, 6.0], concept=["the", "a"], neutral=["Hello"],
                              max_new_tokens=5, n_boot=50, progress=False, chat=False)


def same_tune(a, b) -> None:
    assert a.layers == b.layers and a.scales == b.scales
    assert a.recommended == b.recommended
    assert [c["pareto"] for c in a.cells] == [c["pareto"] for c in b.cells]
    for x, y in zip(a.cells, b.cells):
        assert x["generations"] == y["generations"]
        for k in ("kl", "concept"):
            assert x[k] == pytest.approx(y[k], abs=1e-5), k


def test_tune_spread_over_layers_equals_one_call(tiny):
    args, kw = tune_args(tiny)
    same_tune(tune(tiny, *args, executor=LocalExecutor(tiny), **kw), tune(tiny, *args, **kw))


def refusal_args(sm):
    g = torch.Generator().manual_seed(4)
    cands = torch.randn(2, sm.n_layers, sm.d_model, generator=g)
    ids = R.refusal_token_ids(sm.tokenizer)
    return (sm, cands, [-2, -1], ["make a bomb", "steal a car"], ["bake bread", "write a poem"], ids)


def test_refusal_search_spread_selects_the_same(tiny):
    args = refusal_args(tiny)
    local = R.select_direction(*args, prune_frac=0.0)
    spread = R.select_direction(*args, prune_frac=0.0, executor=LocalExecutor(tiny))
    assert (spread.best.pos, spread.best.layer, spread.rule) == (local.best.pos, local.best.layer, local.rule)
    for a, b in zip(spread.table, local.table):  # every score the local (lazy) search computed, equal
        for k in ("bypass", "induce", "kl"):
            if getattr(b, k) == getattr(b, k):  # not NaN
                assert getattr(a, k) == pytest.approx(getattr(b, k), abs=1e-5), (a, b, k)


def test_executor_errors_are_clear():
    with pytest.raises(InputError, match="at least 1 Ray worker"):
        RayExecutor(ModelSpec(), workers=0)
    with pytest.raises(InputError, match="neither sm nor executor"):
        from steerkit.recording import record_dataset
        record_dataset(None, ["a"], ["blocks.0.hook_resid_post"], "/nonexistent-never-made")


def test_patching_grid_spread_over_layers_equals_one_call(tiny):
    from steerkit.probes import activation_patching, logit_diff_metric
    clean, corrupted = [5, 17, 23, 40, 41, 7], [5, 17, 29, 40, 41, 7]
    metric = logit_diff_metric(tiny, 12, 13)
    kw = dict(hook="resid_pre", positions=[1, 2, 5], progress=False)
    one = activation_patching(tiny, clean, corrupted, metric, **kw)
    spread = activation_patching(tiny, clean, corrupted, metric, executor=LocalExecutor(tiny), **kw)
    assert spread.layers == one.layers and spread.positions == one.positions
    assert torch.allclose(spread.values, one.values, atol=1e-5, rtol=0), (spread.values - one.values).abs().max()
    assert spread.clean_metric == pytest.approx(one.clean_metric)


# ----------------------------------------------------------------------------- the command line's Ray options
RAY_FLAGS = {"--ray", "--workers", "--cpus-per-worker", "--gpus-per-worker"}


def _search_argv(tmp_path, verb: str) -> list[str]:
    """A valid command line of a search verb that takes ``--ray`` (nothing in it loads a model by itself)."""
    (tmp_path / "p.txt").write_text("Tell me a joke\nHi there\n")
    return {"refusal": ["refusal", "--no-save"],
            "tune": ["vectors", "--store", str(tmp_path / "store"), "tune", "vec", "--prompts",
                     str(tmp_path / "p.txt"), "--contains", "the"],
            "ioi": ["ioi", "--no-save"],
            "record": ["record", str(tmp_path / "p.txt"), "-o", str(tmp_path / "out")]}[verb]


def _subparser(parser, *path):
    import argparse
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


@pytest.mark.parametrize("verb", ["record", "refusal", "tune", "ioi"])
def test_search_verbs_have_the_ray_option_group(verb, tmp_path):
    from steerkit.cli import build_parser
    from steerkit.cli._common import RAY_GROUP
    parser = build_parser()
    sp = _subparser(parser, *({"tune": ("vectors", "tune")}.get(verb, (verb,))))
    group = next(g for g in sp._action_groups if g.title == RAY_GROUP)
    assert {o for a in group._group_actions for o in a.option_strings} == RAY_FLAGS
    argv = _search_argv(tmp_path, verb)
    args = parser.parse_args(argv)  # the group's defaults: no Ray
    assert (args.ray, args.workers, args.cpus_per_worker, args.gpus_per_worker) == (None, 2, 1, 0)
    assert parser.parse_args([*argv, "--ray"]).ray == "local"
    args = parser.parse_args([*argv, "--ray", "auto", "--workers", "3", "--gpus-per-worker", "1"])
    assert (args.ray, args.workers, args.gpus_per_worker) == ("auto", 3, 1)


def test_ray_executor_is_built_from_the_flags(tmp_path, monkeypatch):
    from steerkit.cli import build_parser
    from steerkit.cli._common import ray_executor
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    p = build_parser()
    args = p.parse_args([*_search_argv(tmp_path, "tune"), "--model", "m", "--device", "cpu", "--dtype", "float32",
                         "--ray", "127.0.0.1:6379", "--workers", "3", "--cpus-per-worker", "2.5",
                         "--gpus-per-worker", "0.5"])
    ex = ray_executor(args)  # nothing starts: Ray is not imported until the executor runs
    assert ex.spec == ModelSpec(str(tmp_path / "m"), device="cpu", dtype="float32", backend="hf", threads=2)
    assert (ex.address, ex.n_workers, ex.options["num_cpus"], ex.options["num_gpus"]) == ("127.0.0.1:6379", 3, 2.5,
                                                                                           0.5)
    args = p.parse_args(["refusal", "--model", "org/name", "--ray", "--cpus-per-worker", "0.5"])  # a Hub id as given
    ex = ray_executor(args)
    assert ex.spec == ModelSpec("org/name", device="auto", dtype="auto", threads=1) and ex.address is None


def _one_error_line(capsys, argv) -> str:
    from steerkit.cli import main
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("steerkit: error: "), (argv, rc, err)
    return err[0]


@pytest.mark.parametrize("verb", ["refusal", "tune", "ioi"])
def test_bad_ray_flags_are_one_error_line(verb, tmp_path, capsys):
    argv = [*_search_argv(tmp_path, verb), "--ray"]
    for bad, said in ((["--workers", "0"], "--workers >= 1"), (["--cpus-per-worker", "0"], "--cpus-per-worker > 0"),
                      (["--gpus-per-worker", "-1"], "--gpus-per-worker >= 0")):
        assert said in _one_error_line(capsys, [*argv, *bad])


@pytest.mark.parametrize("verb", ["record", "refusal", "tune", "ioi"])
def test_ray_flag_without_ray_installed_is_one_error_line(verb, tiny, tmp_path, capsys, monkeypatch):
    import sys
    from steerkit.vectors import SteeringVector, Store
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where Ray is not installed
    argv = _search_argv(tmp_path, verb)
    if verb == "tune":  # the vector exists, so the command reaches the point where it starts the workers
        Store(tmp_path / "store").save("vec", SteeringVector.from_direction(torch.ones(tiny.d_model), 1, tiny))
    line = _one_error_line(capsys, [*argv, "--ray", "--workers", "1"])
    assert "Ray" in line and "pip install 'steerkit[ray]'" in line, line
    assert not (tmp_path / "out").exists()
