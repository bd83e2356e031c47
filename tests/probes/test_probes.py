"""steerkit.probes: direction finders, the logistic probe as stored arrays, CV metrics, sweeps, the CLI.

Synthetic activations with a planted direction check the maths where the answer is known;
a tiny random Llama checks the recording/scoring/CLI mechanics; one test on the default model
checks that a real concept (sentiment) is found at a middle layer.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.probes import (SweepResult, auroc, balanced_accuracy, bootstrap_auroc_ci, cross_validate,
                             diff_of_means, find_direction, fit_logistic, fit_probe, logistic_pipeline,
                             labels_for, pca_center, pca_diff, pipeline_to_probe, probe_direction, probe_scores,
                             record_activations, score_prompts, sweep, sweep_activations, youden_threshold)
from steerkit.probes.metrics import make_folds



def planted(L=5, n=40, d=16, layer=2, seed=0):
    """Contrast pairs: ``neg_i = b_i + e``, ``pos_i = b_i + a_i u + e'`` at ``layer``; pure noise elsewhere."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)
    acts = rng.normal(size=(L, 2 * n, d))
    b, a = rng.normal(size=(n, d)), rng.uniform(4, 8, size=n)
    acts[layer, :n] = b + a[:, None] * u + 0.1 * rng.normal(size=(n, d))
    acts[layer, n:] = b + 0.1 * rng.normal(size=(n, d))
    y = np.r_[np.ones(n), np.zeros(n)].astype(np.int64)
    return acts, y, u


# ----------------------------------------------------------------------------- synthetic maths
def test_planted_direction_recovered_and_found_by_sweep():
    acts, y, u = planted()
    X = torch.from_numpy(acts[2]).float()
    for method in ("diffmean", "pca_diff", "pca_center"):
        d = find_direction(X, labels=torch.from_numpy(y), method=method)
        assert float(d.vector @ torch.from_numpy(u)) > 0.99, method  # recovered, and oriented pos-up
        s = d.score(X)
        assert s[y == 1].mean() > s[y == 0].mean()
        np.testing.assert_allclose(probe_scores(d.to_probe(2), X), s.numpy(), atol=1e-9)
        sv = d.to_steering_vector(2)
        torch.testing.assert_close(sv.directions[2], (d.vector * d.separation).float())
        assert sv.provenance.method == method
    p = fit_probe(acts[2], labels=y, layer=2)
    assert float(probe_direction(p) @ torch.from_numpy(u)) > 0.8  # the scaled/PCA'd classifier, roughly

    res = sweep_activations(acts, y, method=["logistic", "diffmean", "pca_diff", "pca_center"])
    assert len(res) == 5 * 4 and res.meta["fold_unit"] == "pair"  # paired methods fold by pair
    for r in res.rows:
        if r["layer"] == 2:
            assert r["auroc"] > 0.98 and r["balanced_accuracy"] > 0.9, r
        else:
            assert abs(r["auroc"] - 0.5) < 0.2, r
        assert r["auroc_ci_low"] <= r["auroc"] <= r["auroc_ci_high"]
    assert res.best()["layer"] == 2
    # the same from a [layer, n, d] tensor
    res2 = sweep_activations(torch.from_numpy(acts), torch.from_numpy(y), method="diffmean", paired=True)
    assert [r["auroc"] for r in res2.rows] == [r["auroc"] for r in res.select(method="diffmean")]


def test_finders_orientation_and_input_forms():
    acts, y, _ = planted(seed=1)
    P, N = acts[2][y == 1], acts[2][y == 0]
    torch.testing.assert_close(diff_of_means(P, N), torch.from_numpy(P.mean(0) - N.mean(0)))
    for f in (pca_diff, pca_center):
        v = f(P, N)
        torch.testing.assert_close(v, f(torch.from_numpy(acts[2]), labels=y))
        assert abs(float(v.norm()) - 1) < 1e-12
        assert float(v @ torch.from_numpy(P.mean(0) - N.mean(0))) > 0  # positive class projects higher
        torch.testing.assert_close(f(N, P), -v)  # swapping the classes flips the sign


def _top_eigvec(M):
    w, V = np.linalg.eigh(M.T @ M)
    return V[:, -1]


def test_pca_diff_and_pca_center_match_numpy_reimplementation():
    rng = np.random.default_rng(5)
    n, d = 30, 12
    P = rng.normal(size=(n, d)) @ rng.normal(size=(d, d))
    N = P + rng.normal(size=(n, d)) * np.linspace(0.1, 2, d) + 0.5
    # repeng pca_diff: PCA (which centres) of pos - neg
    D = P - N
    ref_diff = _top_eigvec(D - D.mean(0))
    # repeng pca_center: each pair centred on its midpoint, then PCA of the stacked rows
    c = (P + N) / 2
    H = np.concatenate([P - c, N - c])
    ref_center = _top_eigvec(H - H.mean(0))
    for got, ref in ((pca_diff(P, N).numpy(), ref_diff), (pca_center(P, N).numpy(), ref_center)):
        ref = ref if (P.mean(0) - N.mean(0)) @ ref > 0 else -ref
        np.testing.assert_allclose(got, ref, atol=1e-9)
    from sklearn.decomposition import PCA  # and the library repeng calls
    comp = PCA(n_components=1).fit(D).components_[0]
    assert abs(abs(comp @ pca_diff(P, N).numpy()) - 1) < 1e-9


def test_stored_probe_equals_sklearn_pipeline(tmp_path):
    from steerkit.vectors import Probe, Store, load_artifact, save_artifact
    rng = np.random.default_rng(2)
    for n, d in ((60, 40), (30, 200)):  # PCA to d, and to n - 1
        X = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + rng.normal(size=d)
        y = (X[:, 0] + rng.normal(size=n) > X[:, 0].mean()).astype(int)
        pipe = fit_logistic(X, labels=y)
        assert pipe.named_steps["pca"].n_components_ == min(100, n - 1, d)
        probe = pipeline_to_probe(pipe, layer=3, position=-1)
        ref = Store(tmp_path / f"s{n}").save("p", probe)
        save_artifact(probe, tmp_path / f"p{n}.safetensors")
        Xnew = rng.normal(size=(25, d)) * 3
        want = pipe.decision_function(Xnew)
        for p in (probe, Store(tmp_path / f"s{n}").load(ref), load_artifact(tmp_path / f"p{n}.safetensors")):
            assert isinstance(p, Probe) and p.probe_kind == "logistic"
            np.testing.assert_allclose(probe_scores(p, Xnew), want, rtol=0, atol=1e-6)
            np.testing.assert_allclose(p.predict_proba(torch.from_numpy(Xnew))[:, 1].numpy(),
                                       pipe.predict_proba(Xnew)[:, 1], rtol=0, atol=1e-6)
    assert not list(tmp_path.rglob("*.pkl"))


def test_cv_auroc_equals_sklearn_on_a_fixed_split():
    from sklearn.metrics import roc_auc_score
    rng = np.random.default_rng(3)
    n, d = 50, 20
    y = np.r_[np.ones(25), np.zeros(25)].astype(int)
    X = rng.normal(size=(n, d)) + 0.6 * y[:, None] * rng.normal(size=d)
    folds = make_folds(y, 5, seed=0)
    manual = np.zeros(n)
    for k in range(5):
        tr, te = folds != k, folds == k
        manual[te] = logistic_pipeline(int(tr.sum()), d).fit(X[tr], y[tr]).decision_function(X[te])
    cv = cross_validate(X, y, "logistic", folds)
    np.testing.assert_allclose(cv.scores, manual, atol=1e-9)
    res = sweep_activations(X[None], y, method="logistic", n_folds=5, seed=0)
    assert res.rows[0]["auroc"] == pytest.approx(roc_auc_score(y, manual), abs=1e-12)
    # the rank AUROC handles ties exactly like sklearn
    s = np.round(rng.normal(size=n), 1)
    assert auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_youden_threshold_comes_from_training_folds_only():
    # fold 0: negatives near 0, positives near 1; fold 1: the same shifted by +10. Each fold alone is
    # perfectly separable, so a threshold chosen on the test fold (leakage) gives balanced accuracy 1.
    # Chosen on the training fold, it lands between 10 and 11 for fold 0 and between 0 and 1 for fold 1.
    rng = np.random.default_rng(4)
    m = 6
    x = np.r_[0 + 0.05 * rng.normal(size=m), 1 + 0.05 * rng.normal(size=m),
              10 + 0.05 * rng.normal(size=m), 11 + 0.05 * rng.normal(size=m)]
    y = np.r_[np.zeros(m), np.ones(m), np.zeros(m), np.ones(m)].astype(int)
    folds = np.r_[np.zeros(2 * m), np.ones(2 * m)].astype(int)
    cv = cross_validate(x[:, None], y, "diffmean", folds)
    for k in (0, 1):
        tr = folds != k
        train_scores = x[tr] - (x[tr][y[tr] == 1].mean() + x[tr][y[tr] == 0].mean()) / 2
        assert cv.thresholds[k] == pytest.approx(youden_threshold(y[tr], train_scores))
        te = folds == k
        assert auroc(y[te], cv.scores[te]) == 1.0  # each test fold is separable...
        leaky = youden_threshold(y[te], cv.scores[te])
        assert balanced_accuracy(y[te], cv.scores[te] > leaky) == 1.0  # ...so leakage would score 1
    assert balanced_accuracy(y, cv.pred) == 0.5
    res = sweep_activations(x[None, :, None], y, method="diffmean", folds=folds)
    assert res.rows[0]["balanced_accuracy"] == 0.5 and res.rows[0]["auroc"] == pytest.approx(0.75, abs=0.01)


def test_bootstrap_interval_contains_point_estimate_and_is_seeded():
    rng = np.random.default_rng(6)
    for shift in (0.0, 0.5, 1.5, 5.0):
        y = np.r_[np.ones(30), np.zeros(40)].astype(int)
        s = rng.normal(size=70) + shift * y
        a = auroc(y, s)
        lo, hi = bootstrap_auroc_ci(y, s, n_boot=500, seed=1)
        assert lo <= a <= hi and 0 <= lo and hi <= 1
        if shift < 2:
            assert hi - lo > 0.05
        assert (lo, hi) == bootstrap_auroc_ci(y, s, n_boot=500, seed=1)


def test_bad_inputs_give_clear_errors():
    rng = np.random.default_rng(7)
    X = rng.normal(size=(20, 8))
    y = np.r_[np.ones(10), np.zeros(10)].astype(int)
    with pytest.raises(InputError, match="both classes"):
        sweep_activations(X[None], np.ones(20, int))
    with pytest.raises(InputError, match="at least n_folds=5 samples of each class"):
        sweep_activations(X[None, :8], np.r_[np.ones(4), np.zeros(4)].astype(int))
    with pytest.raises(InputError, match="same width"):
        diff_of_means(X[:10], X[10:, :7])
    with pytest.raises(InputError, match="expected 20 labels"):
        find_direction(X, labels=y[:19])
    with pytest.raises(InputError, match=r"\[layer, n_samples, d_model\]"):
        sweep_activations(np.zeros((2, 3, 4, 5)), y)
    bad = X.copy()
    bad[3, 2] = np.nan
    with pytest.raises(InputError, match=r"NaN or inf in rows \[3\]"):
        fit_probe(bad, labels=y, layer=0)
    with pytest.raises(InputError, match="NaN or inf"):
        sweep_activations(bad[None], y)
    with pytest.raises(InputError, match="as many positives as negatives"):
        pca_diff(X[:10], X[10:18])
    with pytest.raises(InputError, match="expected methods in"):
        sweep_activations(X[None], y, method="svm")
    with pytest.raises(InputError, match="binary labels"):
        find_direction(X, labels=np.arange(20) % 3)


def test_sweep_takes_a_model_prompts_and_labels_only(tiny_dir):
    import steerkit
    acts, y, _ = planted(L=2, n=10, d=4, layer=1)
    with pytest.raises(InputError, match=r"sweep_activations\(acts, labels"):
        sweep(acts, y)
    with pytest.raises(InputError, match=r"sweep_activations\(acts, labels"):
        sweep({"last": acts}, y)
    sm = steerkit.load_model(tiny_dir)
    with pytest.raises(InputError, match=r"labels_for\(pos, neg\)"):
        sweep(sm, POS, NEG)  # two prompt sets: labels_for builds (prompts, labels)
    with pytest.raises(InputError, match="one 0/1 label per prompt"):
        sweep(sm, POS + NEG, None)
    with pytest.raises(InputError, match="expected 12 labels"):
        sweep(sm, POS + NEG, [1, 0])
    prompts, labels = labels_for(POS, NEG)
    assert prompts == POS + NEG and labels.tolist() == [1] * 6 + [0] * 6
    with pytest.raises(InputError, match="single string"):
        labels_for("one prompt", NEG)
    res = sweep_activations(acts[:, :, :], y, method="diffmean", n_boot=20, position="last")
    assert {r["position"] for r in res.rows} == {"last"}


def test_sweep_result_saves_reloads_and_plots(tmp_path):
    acts, y, _ = planted(L=3, n=20, d=8, layer=1)
    res = sweep_activations({"last": acts, "mean": acts[::-1].copy()}, y, method="diffmean", n_boot=100)
    assert len(res) == 6 and {r["position"] for r in res.rows} == {"last", "mean"}
    assert res.best(position="mean")["layer"] == 1 and res.best(position="last")["layer"] == 1
    text = res.to_csv(tmp_path / "s.csv")
    assert text.splitlines()[0].startswith("layer,hook,position,method,auroc,auroc_ci_low")
    assert len(text.splitlines()) == 7
    back = SweepResult.from_json(res.to_json(tmp_path / "s.json"))
    assert back.rows == res.rows and SweepResult.from_json(tmp_path / "s.json").meta == res.meta
    layers, positions, v = res.pivot()
    assert v.shape == (3, 2) and positions == ["last", "mean"]
    pytest.importorskip("plotly")
    fig = res.plot()
    assert len(fig.data) == 4 and fig.layout.xaxis.title.text == "layer"  # a CI band and a line per series
    assert res.save(tmp_path / "s.html").stat().st_size > 1000
    with pytest.raises(InputError, match="loaded from disk"):
        back.fit()


# ----------------------------------------------------------------------------- tiny model mechanics
POS = [f"I love it, great {i}" for i in range(6)]
NEG = [f"bad, awful thing {i}!" for i in range(6)]


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_folder):
    return make_tiny_folder(seed=3)


def test_record_sweep_fit_and_score_on_tiny_model(tiny_dir):
    import steerkit
    sm = steerkit.load_model(tiny_dir)
    acts = record_activations(sm, POS + NEG, positions=["last", -3, "mean"], batch_size=5)
    assert set(acts) == {"last", "-3", "mean"} and acts["last"].shape == (2, 12, 64)
    hooks = steerkit.resid_post(range(2))
    with sm.record(hooks, positions="last") as c1, sm.record(hooks, positions=[-3]) as c3:
        sm.forward(POS + NEG)
    torch.testing.assert_close(acts["last"], c1.stack(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acts["-3"], c3.stack()[:, :, 0], atol=1e-5, rtol=1e-5)
    res = sweep(sm, *labels_for(POS, NEG), positions=["last", -3], method=["diffmean", "logistic"], n_folds=3, n_boot=50)
    assert len(res) == 2 * 2 * 2 and res.meta["model"] == sm.name and sm.hook_count() == 0
    probe = res.fit(layer=1, position=-3, method="logistic")
    assert (probe.layer, probe.provenance.method_params["position"]) == (1, -3)
    assert probe.provenance.metrics["cv_auroc"] == res.select(method="logistic", position=-3)[1]["auroc"]
    np.testing.assert_allclose(score_prompts(sm, probe, POS + NEG), probe_scores(probe, acts["-3"][1]), atol=1e-6)
    with pytest.raises(InputError, match=r"expected token positions in \[-\d+, \d+\].*found \[-30\], which no prompt"):
        record_activations(sm, POS, positions=[-30])
    # first_generated == a teacher-forced pass over prompt + the model's greedy first token
    fg = record_activations(sm, POS[:3], positions=["first_generated", "last"])
    torch.testing.assert_close(fg["last"], acts["last"][:, :3], atol=1e-5, rtol=1e-5)
    first = [t[0] for t in sm.generate(POS[:3], max_new_tokens=1, return_tokens=True)]
    ids = [sm.tokenize(p).input_ids[0].tolist() + [int(t)] for p, t in zip(POS[:3], first)]
    with sm.record(hooks, positions="last") as forced:
        sm.forward(sm.pad(ids))
    torch.testing.assert_close(fg["first_generated"], forced.stack(), atol=1e-4, rtol=1e-4)


def test_cli_probe_fit_and_score_round_trip(tiny_dir, tmp_path, capsys):
    from steerkit.cli import main
    from steerkit.vectors import SteeringVector, Store
    (tmp_path / "pos.json").write_text(json.dumps(POS))
    (tmp_path / "neg.txt").write_text("\n".join(NEG))
    test = ([{"instruction": p, "label": 1} for p in POS[:3]]
            + [{"instruction": p, "label": "negative"} for p in NEG[:3]])
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in test))
    store = str(tmp_path / "store")
    common = ["--model", str(tiny_dir), "--store", store]
    assert main(["probe", "fit", "--pos", str(tmp_path / "pos.json"), "--neg", str(tmp_path / "neg.txt"),
                 "--layer", "1", "--position", "-2", "--name", "toy", "-o", str(tmp_path / "toy.safetensors"),
                 "--folds", "3", *common]) == 0
    out = capsys.readouterr().out
    assert "toy@1" in out and "3-fold CV AUROC" in out
    probe = Store(store).load("toy@1")
    assert probe.provenance.method_params["position"] == -2 and "cv_auroc" in probe.provenance.metrics

    assert main(["probe", "score", "toy@1", "--prompts", str(tmp_path / "test.jsonl"), "--json", *common]) == 0
    got = json.loads(capsys.readouterr().out)
    import steerkit
    want = score_prompts(steerkit.load_model(tiny_dir), probe, [r["instruction"] for r in test])
    np.testing.assert_allclose([r["score"] for r in got["scores"]], want, atol=1e-6)
    assert got["auroc"] == pytest.approx(auroc([1, 1, 1, 0, 0, 0], want)) and got["label_key"] == "label"
    # by file, plain text output
    assert main(["probe", "score", str(tmp_path / "toy.safetensors"), "--prompts", str(tmp_path / "test.jsonl"),
                 *common]) == 0
    out = capsys.readouterr().out
    assert "AUROC" in out and len(out.strip().splitlines()) == 2 + len(test) + 1
    # the sweep verb: two prompt files, labelled 1 / 0 (labels_for), every layer x position
    assert main(["probe", "sweep", "--pos", str(tmp_path / "pos.json"), "--neg", str(tmp_path / "neg.txt"),
                 "--positions", "last,-2", "--method", "diffmean", "--folds", "3", "--n-boot", "20", "--json",
                 "--model", str(tiny_dir)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["rows"]) == 2 * 2 and {r["position"] for r in got["rows"]} == {"last", "-2"}
    assert all(r["n_pos"] == len(POS) and r["n_neg"] == len(NEG) for r in got["rows"])

    # errors: exit code 2 with a message saying what was expected
    Store(store).save("vec", SteeringVector.from_direction(torch.ones(64), 1))
    cases = [
        (["probe", "score", "nope@1", "--prompts", str(tmp_path / "test.jsonl")], "expected an artifact named 'nope'"),
        (["probe", "score", "vec", "--prompts", str(tmp_path / "test.jsonl")], "expected a probe artifact"),
        (["probe", "score", "toy", "--prompts", str(tmp_path / "missing.json")], "expected a prompts file"),
        (["probe", "score", "toy", "--prompts", str(tmp_path / "test.jsonl"), "--label-key", "lbl"],
         "expected a 'lbl' field"),
        (["probe", "fit", "--pos", str(tmp_path / "pos.json"), "--neg", str(tmp_path / "neg.txt"), "--layer", "7",
          "--name", "x"], "expected a layer in 0..1"),
        (["probe", "fit", "--pos", str(tmp_path / "pos.json"), "--neg", str(tmp_path / "neg.txt"), "--layer", "1"],
         "expected --name"),
    ]
    for argv, msg in cases:
        assert main([*argv, *common]) == 2, argv
        assert msg in capsys.readouterr().err, argv


# ----------------------------------------------------------------------------- the default model
SENT_POS = ["I absolutely loved this movie, it was wonderful.", "What a fantastic day, everything went perfectly.",
            "The food was delicious and the staff were so kind.", "This is the best book I have read in years.",
            "I'm thrilled with my new phone, it works beautifully.", "Our holiday was amazing and relaxing.",
            "She gave a brilliant, inspiring performance.", "I am so happy with how the project turned out.",
            "The concert was joyful and the crowd was great.", "This little cafe is lovely, I recommend it."]
SENT_NEG = ["I absolutely hated this movie, it was awful.", "What a terrible day, everything went wrong.",
            "The food was disgusting and the staff were rude.", "This is the worst book I have read in years.",
            "I'm furious with my new phone, it keeps breaking.", "Our holiday was a miserable, stressful mess.",
            "She gave a dull, embarrassing performance.", "I am so disappointed with how the project turned out.",
            "The concert was boring and the crowd was annoying.", "This little cafe is dreadful, avoid it."]


@pytest.mark.slow
def test_sentiment_sweep_on_default_model(sm):
    # contrast pairs: fold by pair so a held-out sentence's twin never sits in the training folds.
    # Every other layer and 8 pairs without the chat template keep this to a few seconds of compute.
    import steerkit
    hooks = steerkit.resid_post(range(0, sm.n_layers, 2))
    res = sweep(sm, *labels_for(SENT_POS[:8], SENT_NEG[:8]), hooks=hooks, positions=["last"], method="logistic", paired=True,
                chat=False)
    assert len(res) == len(hooks) and res.meta["fold_unit"] == "pair" and sm.hook_count() == 0
    middle = [r for r in res.rows if sm.n_layers // 4 <= r["layer"] < 3 * sm.n_layers // 4]
    best = max(middle, key=lambda r: r["auroc"])
    assert best["auroc"] > 0.9, res.table()
    assert best["auroc_ci_low"] <= best["auroc"] <= best["auroc_ci_high"]


# ----------------------------------------------------------------------------- figures
COMPUTE_MODULES = [p for p in (Path(__file__).parents[2] / "probes").rglob("*.py") if "plots" not in p.parts]


@pytest.mark.parametrize("path", COMPUTE_MODULES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_compute_modules_import_no_plotting_library(path):
    """Figures live in ``probes/plots/``: a compute module imports neither plotly nor matplotlib, anywhere."""
    import ast
    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module or ""] if isinstance(n, ast.ImportFrom) else []
        found += [f"{n.lineno}: {m}" for m in names if m.split(".")[0] in ("plotly", "matplotlib")]
    assert not found, found


def test_plot_without_plotly_says_how_to_install_it(monkeypatch):
    """A missing plotly: the figure module's import fails, ``plot()`` raises an InputError naming the extra;
    the sweep falls back to matplotlib and says so when that is missing too."""
    acts, y, _ = planted(L=3, n=10, d=4)
    res = sweep_activations(acts, y, n_folds=2, n_boot=10)
    monkeypatch.setitem(sys.modules, "plotly", None)
    plots_pkg = sys.modules.get("steerkit.probes.plots")
    for name in [m for m in sys.modules if m.startswith(("plotly.", "steerkit.probes.plots."))
                 and not m.endswith(".require")]:
        monkeypatch.delitem(sys.modules, name)
        short = name.rsplit(".", 1)[1]  # an imported submodule is also an attribute of its package
        if name.startswith("steerkit.probes.plots.") and hasattr(plots_pkg, short):
            monkeypatch.delattr(plots_pkg, short)
    with pytest.raises(InputError, match="expected plotly to be installed for backend='plotly'.*pip install plotly"):
        res.plot(backend="plotly")
    from steerkit.probes.methods.caa import CAAResult
    with pytest.raises(InputError, match="expected plotly to be installed to plot.*pip install plotly"):
        CAAResult(torch.zeros(2, 4), [0, 1]).plot()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(InputError, match="expected plotly or matplotlib"):
        res.plot()


def test_rankdata_equals_scipys():
    """The ranks behind every AUROC: scipy.stats.rankdata's average-rank ties, without scipy at run time."""
    st = pytest.importorskip("scipy.stats")
    from steerkit.probes.metrics import rankdata

    rng = np.random.default_rng(0)
    for shape, axis in [((50,), -1), ((7, 40), 1), ((7, 40), 0), ((3, 4, 9), 1)]:
        for k in range(10):
            x = rng.integers(0, 6, size=shape).astype(float) if k % 2 else rng.normal(size=shape)
            assert np.array_equal(rankdata(x, axis=axis), st.rankdata(x, axis=axis)), (shape, axis, k)
