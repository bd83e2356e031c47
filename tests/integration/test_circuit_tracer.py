"""steerkit's transcoders and attribution graphs against circuit-tracer 0.5.0's own, on the same model, transcoders and
prompt, in float32.

circuit-tracer pins transformers<=4.57.3, so it runs in its own environment (``.venv-circuit-tracer``, made by
``STEERKIT_SETUP_EXTRAS=engines bash scripts/setup.sh``; ``STEERKIT_CIRCUIT_TRACER_PYTHON`` points elsewhere), through
``tests/support/circuit_tracer_driver.py``, once for the module. The models are tiny random Llamas whose norms' weights are not 1 and
whose vocabulary (256) is not d_model (64); the model folder keeps ``rope_theta`` for transformers 4, and circuit-tracer
runs its nnsight backend (its TransformerLens backend refuses a local folder). The transcoders are random, written by
steerkit in circuit-tracer's cache layout and loaded there by ``load_transcoders_from_cache``, so every case is also a
round trip of the files. Checked, per case: both sides' logits on the prompt (first), the transcoders' encode / decode
and activations; then the graph: the same active features and logit targets, the adjacency within 1e-4 of its largest
entry, the same pruned nodes and the same edges except those within 1e-4 of the edge threshold, the scores within 1e-5;
and the frontend file against ``create_graph_files``'.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import steerkit
from steerkit.probes import attribution_graph, compute_graph_scores, prune_graph
from steerkit.probes.graph import compute_influence, normalize_matrix
from tiny_models import random_transcoders, tiny_circuit_llama, write_model_folder_for_transformers4

ROOT = Path(__file__).resolve().parents[2]
CT_PY = Path(os.environ.get("STEERKIT_CIRCUIT_TRACER_PYTHON") or ROOT / ".venv-circuit-tracer" / "bin" / "python")
DRIVER = Path(__file__).resolve().parents[1] / "support" / "circuit_tracer_driver.py"
PROMPT = "The quick brown fox jumps over"
#: name -> (transcoder options, attribute's keywords)
CASES = {
    "relu": (dict(activation="relu", d_sae=48, bias=-0.5), dict(batch_size=64)),
    "jumprelu_skip_limited": (dict(activation="jumprelu", skip=True, d_sae=64, seed=1),
                              dict(batch_size=32, max_feature_nodes=300, max_n_logits=5, desired_logit_prob=0.9)),
    "clt_resid_mid": (dict(activation="jumprelu", cross_layer=True, input_hook="hook_resid_mid", d_sae=40, seed=2,
                           scale=0.5), dict(batch_size=128, desired_logit_prob=0.2)),
}

pytestmark = pytest.mark.timeout(900)
if not CT_PY.exists():  # pragma: no cover
    pytest.skip(f"no circuit-tracer environment at {CT_PY}: STEERKIT_SETUP_EXTRAS=engines bash scripts/setup.sh "
                "creates it (circuit-tracer 0.5.0)", allow_module_level=True)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for steerkit's side (restored after), as circuit-tracer's side runs: the CI machines are
    small and shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def run(scratch, one_thread):
    """Both sides on every case: ``{name: (steerkit's graph, its transcoders, circuit-tracer's tensors and json)}``."""
    torch.manual_seed(0)
    tmp = scratch("circuit_tracer")
    model, tok = tiny_circuit_llama()
    folder = write_model_folder_for_transformers4(model, tok, tmp / "model")
    sm = steerkit.wrap(model, tok, name="tiny-circuit-llama")
    ids = steerkit.probes.attribution.prompt_ids(tok, PROMPT)
    cases, ours = [], {}
    for name, (options, params) in CASES.items():
        tc = random_transcoders(sm, **options)
        tc.save(tmp / "cache" / name, "circuit-tracer")
        x = torch.randn(sm.n_layers, 6, sm.d_model) * 3
        save_file({"x": x}, str(tmp / f"{name}-x.safetensors"))
        cases.append({"name": name, "model": folder, "cache_dir": str(tmp / "cache"), "ids": ids, "params": params,
                      "inputs": str(tmp / f"{name}-x.safetensors"), "out": str(tmp / name)})
        ours[name] = (tc, x, params)
    (tmp / "job.json").write_text(json.dumps({"cases": cases}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    r = subprocess.run([str(CT_PY), str(DRIVER), str(tmp / "job.json")], capture_output=True, text=True, timeout=800,
                       cwd=tmp, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    out = {}
    ours_logits = sm.forward(steerkit.Tokens(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)))[0]
    for name, (tc, x, params) in ours.items():
        theirs = load_file(str(tmp / name / "result.safetensors"))
        # the same logits on both sides first: otherwise nothing below would compare like with like
        assert (ours_logits - theirs["logits"]).abs().max() <= 1e-4 * theirs["logits"].abs().max(), name
        loaded = steerkit.load_transcoders(tmp / "cache" / name, model=sm)  # what circuit-tracer read, read back
        graph = attribution_graph(sm, loaded, PROMPT, **params)
        meta = json.loads((tmp / name / "result.json").read_text())
        out[name] = dict(sm=sm, tc=tc, loaded=loaded, x=x, graph=graph, theirs=theirs, meta=meta, folder=tmp / name,
                         params=params)
    return out


@pytest.fixture(params=list(CASES))
def case(request, run):
    return run[request.param]


def test_logits_agree_first(case):
    """Both sides run the same model on the same tokens (transformers 4 and 5, nnsight's eager attention)."""
    sm, g = case["sm"], case["graph"]
    assert g.input_tokens.tolist() == case["theirs"]["input_tokens"].tolist()
    ours = sm.forward(steerkit.Tokens(g.input_tokens[None], torch.ones(1, g.n_pos, dtype=torch.long)))[0]
    theirs = case["theirs"]["logits"]
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_transcoders_round_trip_and_encode_decode_equal(case):
    tc, loaded, x, theirs = case["tc"], case["loaded"], case["x"], case["theirs"]
    assert all(torch.equal(a, b) for a, b in zip(tc.tensors().values(), loaded.tensors().values()))
    assert (loaded.activation, loaded.cross_layer, loaded.input_hook) == (tc.activation, tc.cross_layer, tc.input_hook)
    f = loaded.encode(x)
    assert (f != 0).any() and torch.allclose(f, theirs["encoded"], rtol=0, atol=1e-5)
    y = loaded.decode(f, x)
    assert torch.allclose(y, theirs["decoded"], rtol=0, atol=1e-4 * float(theirs["decoded"].abs().max()))


def test_transcoder_activations_on_the_prompt_equal(case):
    g, theirs = case["graph"], case["theirs"]["activations"]
    dense = torch.zeros_like(theirs)
    layer, pos, feat = g.active_features.T
    dense[layer, pos, feat] = g.activation_values
    assert (dense - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_same_active_features_and_logit_targets(case):
    g, theirs, meta = case["graph"], case["theirs"], case["meta"]
    limit = case["params"].get("max_feature_nodes")
    assert g.n_features == (limit or len(g.active_features)) and (limit is None or limit < len(g.active_features) / 4)
    assert torch.equal(g.active_features, theirs["active_features"])
    assert torch.equal(g.selected_features, theirs["selected_features"])
    assert [[t.token_str, t.vocab_idx] for t in g.logit_targets] == meta["logit_targets"]
    assert torch.allclose(g.logit_probabilities, theirs["logit_probabilities"], rtol=1e-5, atol=1e-7)
    assert g.input_string == meta["input_string"]


def test_adjacency_within_tolerance(case):
    a, b = case["graph"].adjacency_matrix, case["theirs"]["adjacency"]
    assert a.shape == b.shape
    largest = b.abs().max()
    assert largest > 0 and (a - b).abs().max() <= 1e-4 * largest
    assert torch.equal(a == 0, b == 0)  # the same structure: causality and block order give exact zeros on both


def test_same_pruned_nodes_edges_and_scores(case):
    g, theirs, meta = case["graph"], case["theirs"], case["meta"]
    node_mask, edge_mask, cumulative = prune_graph(g)
    assert torch.equal(node_mask, theirs["node_mask"])
    assert torch.allclose(cumulative, theirs["cumulative_scores"], atol=1e-5)
    differ = edge_mask != theirs["edge_mask"]
    if differ.any():  # only edges on the threshold's edge may differ
        weights = torch.zeros(g.adjacency_matrix.shape[0])
        weights[-g.n_logits:] = g.logit_probabilities
        pruned = g.adjacency_matrix.clone()
        pruned[~node_mask], pruned[:, ~node_mask] = 0, 0
        normalized = normalize_matrix(pruned)
        scores = normalized * (compute_influence(normalized, weights) + weights)[:, None]
        threshold = scores[edge_mask].min()
        assert ((scores[differ] - threshold).abs() <= 1e-4 * threshold).all()
    assert differ.sum() <= 1e-3 * edge_mask.sum()
    ours = compute_graph_scores(g)
    assert abs(ours[0] - meta["scores"][0]) <= 1e-5 and abs(ours[1] - meta["scores"][1]) <= 1e-5


def test_frontend_file_equals_create_graph_files(run, tmp_path):
    case = run["relu"]
    path = case["graph"].to_json(tmp_path / "relu.json", scan="tiny")
    ours, theirs = json.loads(path.read_text()), json.loads((case["folder"] / "relu.json").read_text())
    assert ours["metadata"] == theirs["metadata"] and ours["qParams"] == theirs["qParams"]
    strip = ("influence", "activation", "token_prob", "clerp")
    assert [{k: v for k, v in n.items() if k not in strip} for n in ours["nodes"]] == \
        [{k: v for k, v in n.items() if k not in strip} for n in theirs["nodes"]]
    for a, b in zip(ours["nodes"], theirs["nodes"]):
        for key in ("influence", "activation", "token_prob"):
            assert (a[key] is None) == (b[key] is None) and (a[key] is None or abs(a[key] - b[key]) <= 1e-5)
    assert [(e["source"], e["target"]) for e in ours["links"]] == [(e["source"], e["target"]) for e in theirs["links"]]
    largest = max(abs(e["weight"]) for e in theirs["links"])
    assert max(abs(a["weight"] - b["weight"]) for a, b in zip(ours["links"], theirs["links"])) <= 1e-4 * largest
    listed = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [m["slug"] for m in listed] == ["relu"]
