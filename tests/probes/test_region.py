"""The efficient-reasoning region (Hou et al.; probes/methods/region.py), the Region artifact's projection, and
token-pattern positions (positions.TokenMatch / AnyOf).

Mechanics on synthetic data and tiny random models; one short end-to-end check on the default model.
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from steerkit.errors import InputError
from steerkit.model import wrap
from steerkit.hooks.positions import AnyOf, TokenMatch
from steerkit.probes.methods import problems as Q
from steerkit.probes.methods import region as R
from steerkit.vectors import Region
from tiny_models import tiny_model

torch.set_num_threads(1)

QP_TOL = 1e-3  # Region.project (natural residual 1e-4 in distance units) vs SLSQP, max abs difference


def _sm(**kw):
    model, tok = tiny_model("llama", **kw)
    return wrap(model, tok, name="tiny-llama")


def _planted(seed=0, d=32, n_c=150, n_v=60):
    """Concise points around 0; three verbose clusters, each shifted along its own direction."""
    g = np.random.default_rng(seed)
    dirs = np.linalg.qr(g.normal(size=(d, 3)))[0].T  # 3 orthonormal directions
    concise = g.normal(size=(n_c, d)) * 0.5
    verbose = np.concatenate([g.normal(size=(n_v, d)) * 0.5 + 6.0 * dirs[j] for j in range(3)])
    return concise, verbose, dirs, g


# --------------------------------------------------------------------------- fit
def test_planted_region_separates_the_clusters():
    concise, verbose, dirs, g = _planted()
    reg = R.fit_region(torch.tensor(concise), verbose, n_components=5, n_clusters=3, layer=4, seed=0)
    m = reg.provenance.metrics
    assert reg.layer == 4 and reg.projection.shape == (5, 32) and reg.normals.shape == (3, 5)
    assert m["n_clusters"] == 3 and sorted(c["size"] for c in m["clusters"]) == [60, 60, 60]
    assert m["verbose_inside"] == 0.0 and m["concise_inside"] >= 0.7  # each c_k is a 90th percentile
    # PCA rows orthonormal, unit normals, one half-space facing each planted cluster
    P = reg.projection.double()
    assert torch.allclose(P @ P.T, torch.eye(5, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(reg.normals.norm(dim=1), torch.ones(3), atol=1e-5)
    facing = (reg.normals.double() @ P @ torch.tensor(dirs).T)  # [half-space, cluster direction]
    assert sorted(facing.argmax(1).tolist()) == [0, 1, 2] and float(facing.max(1).values.min()) > 0.7
    # fresh samples: verbose-like points fall outside, the concise centre inside, and contains() agrees
    fresh_v = torch.tensor(g.normal(size=(30, 32)) * 0.5 + 6.0 * dirs[1], dtype=torch.float32)
    assert not bool(reg.contains(fresh_v).any())
    assert bool(reg.contains(torch.zeros(1, 32)).all())
    inside = reg.contains(torch.tensor(concise, dtype=torch.float32)).float().mean()
    assert float(inside) == pytest.approx(m["concise_inside"], abs=1e-6)
    # c_k = max(q90(w.z_concise), w.mean(z_concise))
    z = reg.coordinates(torch.tensor(concise, dtype=torch.float32)).double()
    for k in range(3):
        s = z @ reg.normals[k].double()
        want = max(float(np.quantile(s.numpy(), 0.9)), float(z.mean(0) @ reg.normals[k].double()))
        assert float(reg.offsets[k]) == pytest.approx(want, abs=1e-4)
    # fewer verbose points than n_clusters * min_cluster_size: fewer clusters
    small = R.fit_region(concise, verbose[:12], n_components=5, n_clusters=8, min_cluster_size=5)
    assert small.provenance.metrics["n_clusters"] == 2 and small.layer == 0
    with pytest.raises(Exception, match="at least 2 concise"):
        R.fit_region(concise[:1], verbose)


# --------------------------------------------------------------------------- projection
def _qp_scipy(z, W, c):
    from scipy.optimize import minimize
    res = minimize(lambda x: 0.5 * float(((x - z) ** 2).sum()), z.copy(), jac=lambda x: x - z, method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda x: c - W @ x, "jac": lambda x: -W}],
                   options={"ftol": 1e-12, "maxiter": 500})
    assert res.success, res.message
    return res.x


def test_project_matches_an_independent_qp_solver_and_the_kernel():
    from steerkit.kernels import fused_steer
    g = np.random.default_rng(1)
    k, nh, d = 6, 8, 24
    W = g.normal(size=(nh, k)) * g.uniform(0.3, 3.0, size=(nh, 1))  # unnormalised rows on purpose
    c = g.uniform(0.5, 2.0, size=nh)
    P = np.linalg.qr(g.normal(size=(d, k)))[0].T
    mean = g.normal(size=d)
    reg = Region(mean=torch.tensor(mean, dtype=torch.float32), projection=torch.tensor(P, dtype=torch.float32),
                 normals=torch.tensor(W, dtype=torch.float32), offsets=torch.tensor(c, dtype=torch.float32), layer=0)
    Z = g.normal(size=(40, k)) * 3.0
    Z[:5] *= 0.01  # a few points inside
    got = reg.project(torch.tensor(Z)).numpy()
    W32, c32 = reg.normals.double().numpy(), reg.offsets.double().numpy()
    for i in range(len(Z)):
        ref = _qp_scipy(Z[i], W32, c32)
        assert np.abs(got[i] - ref).max() <= QP_TOL, (i, got[i], ref)
    assert (W32 @ got.T - c32[:, None]).max() <= 1e-3  # feasible
    inside = (W32 @ Z.T <= c32[:, None]).all(0)
    assert inside[:5].all() and np.array_equal(got[inside], Z[inside])  # inside points come back unchanged
    assert reg.project(torch.tensor(Z[:4]).reshape(2, 2, k)).shape == (2, 2, k)
    with pytest.raises(Exception, match="coordinates"):
        reg.project(torch.zeros(3, k + 1))
    # the fused kernel's region edit moves h by P^T (z* - z), z* the same point
    h = torch.tensor(mean + Z @ P + g.normal(size=(40, d)) * 0.1, dtype=torch.float32)
    out = fused_steer(h[None], region=reg, region_strength=1.0)[0]
    z = reg.coordinates(h.double())
    want = h.double() + (reg.project(z) - z) @ reg.projection.double()
    assert (out.double() - want).abs().max() <= QP_TOL
    half = fused_steer(h[None], region=reg, region_strength=0.5)[0]
    assert (half.double() - (h.double() + 0.5 * (want - h.double()))).abs().max() <= QP_TOL


def test_region_artifact_round_trips_through_the_store(tmp_path):
    from steerkit.vectors import Store
    concise, verbose, _, _ = _planted(seed=2, d=16, n_c=40, n_v=20)
    sm = _sm()
    reg = R.fit_region(concise, verbose, n_components=4, n_clusters=3, layer=1, prompts=["a", "b"])
    reg2 = R.fit_region(np.random.default_rng(0).normal(size=(30, 64)), np.random.default_rng(1).normal(size=(30, 64)) + 2,
                        n_components=4, n_clusters=2, model=sm)
    assert reg2.layer == R.default_layer(sm.n_layers) and reg2.provenance.model_fingerprint == sm.fingerprint()
    store = Store(tmp_path / "store")
    for name, r in (("region-a", reg), ("region-b", reg2)):
        ref = store.save(name, r)
        back = store.load(ref)
        assert isinstance(back, Region) and back == r
        assert back.provenance.method == R.METHOD and back.provenance.metrics["clusters"] == r.provenance.metrics["clusters"]
        z = torch.randn(5, 4) * 5
        assert torch.equal(back.project(z), r.project(z))


# --------------------------------------------------------------------------- positions + steering
def test_token_match_positions_on_prompts():
    sm = _sm()
    tok = sm.tokenizer
    nl = tok("\n", add_special_tokens=False)["input_ids"][0]
    b = R.step_boundaries(tok)
    assert b.single == () and nl in b.first and nl in b.second  # char-level: "\n\n" is two tokens
    with sm.record("blocks.0.hook_resid_post", positions=AnyOf("last", b.spec("all"))) as c:
        sm.forward(["ab\n\ncd", "x\n\n\ny"], chat=False)
    # left padding: row 0 has 6 tokens, row 1 has 5 (one pad); 2nd "\n" of each pair + the last token
    assert c.positions("blocks.0.hook_resid_post").tolist() == [[3, 5, -1], [3, 4, 5]]
    with sm.record("blocks.0.hook_resid_post", positions=TokenMatch([nl], within="prompt")) as c:
        sm.forward(["a\nb"], chat=False)
    assert c.positions("blocks.0.hook_resid_post").tolist() == [[1]]
    with pytest.raises(Exception, match="TokenMatch|token ids"):
        TokenMatch([], within="all")
    with pytest.raises(Exception, match="within"):
        TokenMatch([1], within="nowhere")


def _three_token_head(sm, tokens):
    """Replace the unembedding so sampling picks uniformly among ``tokens`` whatever the hidden state:
    generated tokens are then the same with and without an edit."""
    V = sm.hf_model.lm_head.out_features
    head = torch.nn.Linear(sm.d_model, V, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e9)
        head.bias[tokens] = 0.0
    sm.hf_model.lm_head = head


def test_steering_fires_exactly_at_last_prompt_token_and_generated_boundaries():
    sm = _sm(num_hidden_layers=3)
    tok = sm.tokenizer
    ids = {ch: tok(ch, add_special_tokens=False)["input_ids"][0] for ch in ("\n", "a", "b")}
    _three_token_head(sm, list(ids.values()))
    g = torch.Generator().manual_seed(0)
    P = torch.linalg.qr(torch.randn(sm.d_model, 4, generator=g))[0].T
    # a half-space no state satisfies: every edited row moves (by exactly the projection step)
    reg = Region(mean=torch.zeros(sm.d_model), projection=P, normals=torch.tensor([[1.0, 0, 0, 0]]),
                 offsets=torch.tensor([-50.0]), layer=1)
    prompts = ["ab\n\nab", "b\nab"]  # "\n\n" inside a prompt is not a generated boundary
    names = ["blocks.2.hook_resid_pre"]
    kw = dict(max_new_tokens=24, chat=False, do_sample=True, seed=3, return_tokens=True)
    with sm.record(names, positions="all") as base:
        t0 = sm.generate(prompts, **kw)
    with pytest.warns(UserWarning, match="no model fingerprint"):  # a hand-made region
        handle = R.steer_region(sm, reg)
    with sm.record(names, positions="all") as st, handle:
        t1 = sm.generate(prompts, **kw)
    assert t0 == t1 and sm.hook_count() == 0
    b = R.step_boundaries(tok)
    x0, x1 = base[names[0]], st[names[0]]
    lens = base.lengths(names[0])
    n_gen_boundaries = 0
    for r, p in enumerate(prompts):
        pid = tok(p, add_special_tokens=False)["input_ids"]
        full = pid + t0[r]
        assert int(lens[r]) == len(full)
        bm = b.mask(full)
        want = [i == len(pid) - 1 or (i >= len(pid) and bm[i]) for i in range(len(full))]
        moved = ((x1[r, :len(full)] - x0[r, :len(full)]).abs().amax(-1) > 1e-5).tolist()
        assert moved == want, (r, full)
        n_gen_boundaries += sum(want[len(pid):])
        # the edit is h + P^T (z* - z) with z* the closest point of the region
        h = x0[r, :len(full)][torch.tensor(want)].double()
        z = reg.coordinates(h)
        expect = h + (reg.project(z) - z) @ reg.projection.double()
        assert (x1[r, :len(full)][torch.tensor(want)].double() - expect).abs().max() < 1e-3
    assert n_gen_boundaries >= 2  # the sampled "\n\n" pairs were there to be found


def test_region_features_only_inside_the_response():
    sm = _sm()
    prompts, texts = ["q\n\nq", "r"], ["a\n\nb\n\nc", "x y"]
    f, counts = R.region_features(sm, texts, 1, prompts=prompts, chat=False, return_counts=True)
    assert counts == [2, 0] and f.shape == (2, sm.d_model)
    with sm.record("blocks.1.hook_resid_post", positions="all") as c:
        sm.forward([prompts[0] + texts[0]], chat=False)
    full = c["blocks.1.hook_resid_post"][0]
    assert torch.allclose(f, full[[6, 9]], atol=1e-5)  # the second "\n" of each response pair
    g = R.region_features(sm, ["a\n\nb"], 1, chat=False)  # whole texts: every boundary counts
    assert g.shape == (1, sm.d_model)


# --------------------------------------------------------------------------- data
def test_problem_generators_and_answer_parsing():
    ps = R.arithmetic_problems(40, seed=0)
    assert len({p.question for p in ps}) == 40
    held = R.arithmetic_problems(20, seed=1, exclude=[p.question for p in ps])
    assert not {p.question for p in held} & {p.question for p in ps}
    for p in ps:
        if p.question.startswith("What is"):
            assert eval(p.question[len("What is "):-1]) == p.answer
    med = R.arithmetic_problems(16, seed=0, level="medium")
    assert all(p.answer >= 0 for p in med)
    gs = R.gsm8k_problems(5)
    assert len(gs) == 5 and gs[0].answer == 18.0 and gs[1].answer == 3.0 and gs[0].source == "gsm8k"
    assert len(R.gsm8k_problems(offset=290)) == 10
    assert R.parse_answer("so 3 + 4 = 7.\n\nThe answer is 7.") == 7.0
    assert R.parse_answer("The answer is $1,250.50. Later 9") == 1250.5
    assert R.parse_answer("... #### 42") == 42.0 and R.parse_answer("x \\boxed{-3}") == -3.0
    assert R.parse_answer("we get 12 then 15") == 15.0 and R.parse_answer("no numbers") is None
    assert R.is_correct("The answer is 19.", 19) and not R.is_correct("The answer is 18.", 19)
    assert Q.trim_solution("4 * 6 = 24\n\nThe answer is 24.\n\nQuestion: next") == "4 * 6 = 24\n\nThe answer is 24."
    assert R.segment_steps("So 3.5 + 1 = 4.5. Then add 2.\nThe answer is 6.5.") == \
        "So 3.5 + 1 = 4.5.\n\nThen add 2.\n\nThe answer is 6.5.\n\n"
    sols = [R.Solution(ps[0], "concise", t, [1, 2], c, f) for t, c, f in
            (("The answer is 1.", True, False), ("so 5", False, True), ("we get 3 and", False, False))]
    assert R.select_solutions(sols, "correct", min_kept=1) == ([sols[0]], "correct")
    kept, how = R.select_solutions(sols, "correct", min_kept=2)
    assert kept == sols[:2] and how.startswith("answered (fallback")


# --------------------------------------------------------------------------- default model (short)
def test_default_model_end_to_end(sm):
    tok = sm.tokenizer
    b = R.step_boundaries(tok)
    nn = tok("\n\n", add_special_tokens=False)["input_ids"]
    assert nn[-1] in b.single or (len(nn) == 2 and nn[0] in b.first and nn[1] in b.second)
    ids = tok("Step 1: 3+4=7.\n\nStep 2: 7*2=14.", add_special_tokens=False)["input_ids"]
    assert sum(b.mask(ids)) == 1
    layer = R.default_layer(sm.n_layers)
    assert layer == 20
    qs = [p.question for p in R.arithmetic_problems(4, seed=0)]
    verbose = [("First we look at the numbers in the problem carefully.\n\nThen we add the first two of them "
                "together.\n\nAfter that we add the last one.\n\nSo the total is 12.\n\nThe answer is 12.")] * 2
    concise = ["3 + 4 = 7\n\n7 + 5 = 12\n\nThe answer is 12.", "2 * 3 = 6\n\nThe answer is 6."]
    pr = [R.EVAL_PROMPT.format(question=q) for q in qs]
    fv, cv = R.region_features(sm, verbose, layer, prompts=pr[:2], return_counts=True)
    fc, cc = R.region_features(sm, concise, layer, prompts=pr[2:], return_counts=True)
    assert cv == [4, 4] and cc == [2, 1] and fv.shape == (8, sm.d_model)
    reg = R.fit_region(fc, fv, n_components=3, n_clusters=2, min_cluster_size=2, layer=layer, model=sm)
    assert reg.provenance.n_layers == sm.n_layers and reg.provenance.metrics["verbose_inside"] < 1.0
    probs = R.arithmetic_problems(2, seed=7)
    ev = R.region_eval(sm, probs, reg, max_new_tokens=12)
    for k in ("baseline", "projected"):
        assert ev[k]["n"] == 2 and 0 <= ev[k]["tokens_mean"] <= 12 and 0 <= ev[k]["accuracy"] <= 1
    assert sm.hook_count() == 0


def test_cli_registers_region():
    from steerkit.cli import build_parser
    a = build_parser().parse_args(["region", "--n-train", "4", "--n-test", "2", "--data", "mix"])
    assert a.func is not None and a.method == "region" and a.n_train == 4 and a.data == "mix"


def test_region_steers_through_its_own_interventions():
    sm = _sm(num_hidden_layers=3)
    reg = Region(mean=torch.zeros(sm.d_model), projection=torch.eye(sm.d_model)[:2], normals=torch.tensor([[1.0, 0.0]]),
                 offsets=torch.tensor([0.5]), layer=1, hook_site="hook_resid_pre")
    with pytest.warns(UserWarning, match="no model fingerprint"):
        spec = R.region_spec(reg, 0.5, sm.facts)
    assert [(iv.site, iv.op, iv.scale, iv.region is reg) for iv in spec] == [
        ("blocks.1.hook_resid_pre", "project", 0.5, True)]
    with pytest.raises(InputError, match="sm.facts"):
        R.region_spec(reg, 0.5)
    # steer_region is the region's own steering at the method's positions
    prompts = ["ab\n\nab", "b\nab"]
    kw = dict(max_new_tokens=6, chat=False, return_tokens=True)
    with pytest.warns(UserWarning), R.steer_region(sm, reg, 0.5):
        got = sm.generate(prompts, **kw)
    with sm.steer(spec, positions=R.steering_positions(sm.tokenizer)):
        ref = sm.generate(prompts, **kw)
    assert got == ref and sm.hook_count() == 0


@pytest.mark.parametrize("path", ["probes/tune.py", "probes/tune_result.py", "probes/methods/temporal.py",
                                  "probes/methods/region.py", "probes/methods/problems.py"])
def test_compute_modules_import_neither_the_kernels_nor_plotting(path):
    tree = ast.parse((Path(__file__).resolve().parents[2] / path).read_text(encoding="utf-8"))
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if m.startswith(("steerkit.kernels", "plotly", "matplotlib"))], mods
