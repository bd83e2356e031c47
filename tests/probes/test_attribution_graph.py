"""Attribution graphs (steerkit.probes.attribution_graph) on tiny random Llamas whose norms' weights are not 1,
checked without circuit-tracer (tests/integration/test_circuit_tracer.py compares with it): every row of the
adjacency against a reference written the other way round -- the frozen replacement model run *forward* and
differentiated with autograd -- for ReLU, JumpReLU with a skip connection, TopK (which circuit-tracer cannot load) and
cross-layer transcoders, and for each input site; the node layout; a limited graph's rows are the full graph's;
custom targets; pruning and scores on graphs whose answers are known; the frontend file against Neuronpedia's schema
with the jsonschema library; the families and transcoders refused. Where the graph is computed: the model's device
by default, ``device=`` another (every tensor the computation makes names its device; on a CUDA machine the graph
computed there equals the CPU's), no process-wide setting touched, a progress bar. The module runs torch on one
thread (restored after): the CI machines are small and shared, where many tiny multi-threaded ops stall."""
from __future__ import annotations

import concurrent.futures
import copy
import json
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import steerkit
import steerkit.probes.attribution as attribution
import steerkit.probes.graph_rows as graph_rows
from steerkit.errors import InputError, UnsupportedArchitectureError
from steerkit.probes import Graph, LogitTarget, attribution_graph, compute_graph_scores, prune_graph
from steerkit.probes.attribution import prompt_ids
from steerkit.probes.graph_json import graph_schema
from steerkit.vectors import Transcoders
from tiny_models import random_transcoders, tiny_circuit_llama, tiny_model

PROMPT = "Hello world, it is"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sm(circuit_sm):
    return circuit_sm


def reference_rows(sm, tc: Transcoders, graph: Graph, rows: list[int]) -> torch.Tensor:
    """The adjacency rows ``rows`` of ``graph`` computed independently: the frozen replacement model written as a
    forward pass (patterns, norm scales and MLP outputs recorded from the model, each MLP output split into the
    transcoder's skip of its input plus a constant), and autograd of each target's value."""
    a, m, L = sm.adapter, sm.hf_model, sm.n_layers
    ids = graph.input_tokens
    P, H, KV, dh = len(ids), sm.n_heads, sm.n_kv_heads, sm.d_head
    names = ["blocks.0.hook_resid_pre", "ln_final.hook_scale"] + [
        f"blocks.{l}.{k}" for l in range(L) for k in ("ln1.hook_scale", "ln2.hook_scale", "attn.hook_pattern",
                                                        "hook_mlp_out", tc.input_hook)]
    with sm.record(names) as c:
        logits = sm.forward(steerkit.Tokens(ids[None], torch.ones(1, P, dtype=torch.long)))[0]
    c = {k: c[k][0] for k in names}
    attn = [a.attn_module(m, l) for l in range(L)]

    def forward(emb, consts):
        resid, ins = emb, []
        for l in range(L):
            w1 = a.block_norm_module(m, l, "ln1").weight
            h = resid / c[f"blocks.{l}.ln1.hook_scale"] * w1
            v = (h @ attn[l].v_proj.weight.T).view(P, KV, dh).repeat_interleave(H // KV, dim=1)  # [P, H, dh]
            z = torch.einsum("hqk,khd->qhd", c[f"blocks.{l}.attn.hook_pattern"], v).reshape(P, H * dh)
            resid = resid + z @ attn[l].o_proj.weight.T
            normalized = resid / c[f"blocks.{l}.ln2.hook_scale"]
            w2 = a.block_norm_module(m, l, "ln2").weight
            x = {"mlp.hook_in": normalized * w2, "ln2.hook_normalized": normalized, "hook_resid_mid": resid}[tc.input_hook]
            ins.append(x)
            resid = resid + tc.skip(x, l) + consts[l]
        return ins, resid / c["ln_final.hook_scale"] * a.final_norm_module(m).weight

    emb = c["blocks.0.hook_resid_pre"].clone().requires_grad_(True)
    skips = [tc.skip(c[f"blocks.{l}.{tc.input_hook}"], l) for l in range(L)]
    consts = [(c[f"blocks.{l}.hook_mlp_out"] - skips[l]).clone().requires_grad_(True) for l in range(L)]
    ins, final = forward(emb, consts)
    for l in range(L):  # the forward reproduces the model: the recorded pieces are the frozen model's
        assert torch.allclose(ins[l], c[f"blocks.{l}.{tc.input_hook}"], atol=1e-4)
    assert torch.allclose(final @ a.unembed_module(m).weight.T, logits, atol=1e-3)
    n_sel, active = graph.n_features, graph.active_features[graph.selected_features]
    acts = graph.activation_values[graph.selected_features]
    unembed = a.unembed_module(m).weight
    recon = tc.decode(_dense_acts(graph, tc, P), torch.stack([c[f"blocks.{l}.{tc.input_hook}"] for l in range(L)]))
    err = torch.stack([c[f"blocks.{l}.hook_mlp_out"] for l in range(L)]) - recon  # what the transcoders miss
    err[:, 0] = 0
    out = []
    for t in rows:
        if t >= graph.adjacency_matrix.shape[0] - graph.n_logits:
            vocab = graph.logit_targets[t - (graph.adjacency_matrix.shape[0] - graph.n_logits)].vocab_idx
            value = final[P - 1] @ (unembed[vocab] - unembed.mean(0))
        else:
            l, p, f = active[t].tolist()
            value = ins[l][p] @ tc.W_enc[l][f]
        grads = torch.autograd.grad(value, [emb, *consts], retain_graph=True, allow_unused=True)
        g_emb, *g = [torch.zeros(P, sm.d_model) if x is None else x for x in grads]  # None: above the target
        row = torch.zeros(graph.adjacency_matrix.shape[1])
        for i, (l, p, f) in enumerate(active.tolist()):
            if tc.cross_layer:
                row[i] = sum(g[k][p] @ tc.W_dec[l][f, k - l] for k in range(l, L)) * acts[i]
            else:
                row[i] = g[l][p] @ tc.W_dec[l][f] * acts[i]
        row[n_sel: n_sel + L * P] = (torch.stack(g) * err).sum(-1).flatten()
        row[n_sel + L * P: n_sel + (L + 1) * P] = (g_emb * emb).sum(-1)
        out.append(row)
    return torch.stack(out).detach()


def _dense_acts(graph: Graph, tc: Transcoders, P: int) -> torch.Tensor:
    f = torch.zeros(tc.n_layers, P, tc.d_sae)
    l, p, i = graph.active_features.T
    f[l, p, i] = graph.activation_values
    return f


@pytest.mark.parametrize("options", [
    dict(activation="relu", bias=-0.5),
    dict(activation="jumprelu", skip=True, seed=1),
    dict(activation="topk", k=6, seed=2),
    dict(activation="jumprelu", cross_layer=True, seed=3, scale=0.7),
    dict(activation="relu", input_hook="hook_resid_mid", seed=4, scale=0.3),
    dict(activation="relu", input_hook="ln2.hook_normalized", seed=5),
], ids=["relu", "jumprelu-skip", "topk", "cross-layer", "resid-mid", "ln2-normalized"])
def test_rows_equal_the_forward_replacement_model_differentiated(sm, options):
    tc = random_transcoders(sm, d_sae=32, **options)
    graph = attribution_graph(sm, tc, PROMPT, batch_size=7)
    N = graph.adjacency_matrix.shape[0]
    assert graph.n_features == len(graph.active_features) > 50
    g = torch.Generator().manual_seed(0)
    rows = sorted(set(torch.randint(0, graph.n_features, (6,), generator=g).tolist()) | {N - 1, N - graph.n_logits})
    want = reference_rows(sm, tc, graph, rows)
    got = graph.adjacency_matrix[rows]
    assert (got != 0).sum() > 20
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_node_layout_and_conventions(sm):
    tc = random_transcoders(sm, d_sae=32)
    graph = attribution_graph(sm, tc, PROMPT)
    ids = prompt_ids(sm.tokenizer, PROMPT)
    assert graph.input_tokens.tolist() == ids and ids[0] == sm.tokenizer.bos_token_id
    assert graph.prompt_tokens == [sm.tokenizer.decode([t]) for t in ids] and graph.input_string == sm.tokenizer.decode(ids)
    af = graph.active_features
    assert af.dtype == torch.long and af.shape[1] == 3 and (af[:, 1] > 0).all()  # nothing at the special token
    keys = af[:, 0] * 10**8 + af[:, 1] * 10**4 + af[:, 2]
    assert torch.equal(keys, keys.sort().values)  # sorted: block, position, feature
    direct = tc.encode(torch.stack([sm_record(sm, ids, f"blocks.{l}.mlp.hook_in") for l in range(sm.n_layers)]))
    assert torch.allclose(graph.activation_values, direct[af[:, 0], af[:, 1], af[:, 2]], atol=1e-5)
    N, n, L, P = graph.adjacency_matrix.shape[0], graph.n_features, sm.n_layers, graph.n_pos
    assert N == n + L * P + P + graph.n_logits
    adj = graph.adjacency_matrix
    assert not adj[n: N - graph.n_logits].any()  # errors and tokens have no incoming edges
    assert not adj[:, N - graph.n_logits:].any()  # logits have no outgoing ones
    assert not adj[:, n: n + L * P].reshape(N, L, P)[:, :, 0].any()  # no error at the special token
    for i in range(0, n, max(1, n // 25)):  # causal, block order: a feature reads nothing later or from its block
        l, p, _ = af[i].tolist()
        later = (af[:, 0] >= l) | (af[:, 1] > p)
        assert not adj[i, :n][later].any()
    probs = torch.softmax(sm.forward(steerkit.Tokens(torch.tensor([ids]), torch.ones(1, P, dtype=torch.long)))[0, -1], -1)
    top = probs.topk(10)
    assert [t.vocab_idx for t in graph.logit_targets] == top.indices[: graph.n_logits].tolist()
    assert torch.allclose(graph.logit_probabilities, top.values[: graph.n_logits])
    assert graph.logit_targets[0] == LogitTarget(sm.tokenizer.decode(top.indices[0]), int(top.indices[0]))
    assert torch.equal(graph.sparse_adjacency().to_dense(), adj)


def sm_record(sm, ids, site):
    with sm.record(site) as c:
        sm.forward(steerkit.Tokens(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)))
    return c[site][0]


def test_limited_graph_rows_are_the_full_graph_rows(sm):
    tc = random_transcoders(sm, d_sae=48, activation="jumprelu", skip=True, seed=7)
    full = attribution_graph(sm, tc, PROMPT, batch_size=16)
    limited = attribution_graph(sm, tc, PROMPT, batch_size=16, max_feature_nodes=60)
    other_batches = attribution_graph(sm, tc, PROMPT, batch_size=5)
    assert torch.allclose(other_batches.adjacency_matrix, full.adjacency_matrix, atol=1e-5)
    sel = limited.selected_features
    assert limited.n_features == 60 < full.n_features and torch.equal(sel, sel.sort().values)
    cols = torch.cat([sel, torch.arange(full.n_features, full.adjacency_matrix.shape[0])])
    rows = torch.cat([sel, torch.arange(full.adjacency_matrix.shape[0] - full.n_logits, full.adjacency_matrix.shape[0])])
    want = full.adjacency_matrix[rows][:, cols]
    got = torch.cat([limited.adjacency_matrix[:60], limited.adjacency_matrix[-limited.n_logits:]])
    assert torch.allclose(got, want, atol=1e-5)
    # the kept features are the influential ones: on average far more influential than those left out
    influence = prune_graph(full).cumulative_scores[: full.n_features]
    left = torch.ones(full.n_features, dtype=torch.bool)
    left[sel] = False
    assert influence[sel].mean() < influence[left].mean()  # cumulative scores: lower is more influential


def test_targets_asked_for(sm):
    tc = random_transcoders(sm, d_sae=32)
    tokens = [sm.tokenizer.encode(c, add_special_tokens=False)[0] for c in ("a", "b")]
    by_id = attribution_graph(sm, tc, PROMPT, attribution_targets=torch.tensor(tokens))
    by_text = attribution_graph(sm, tc, PROMPT, attribution_targets=["a", "b"])
    assert [t.vocab_idx for t in by_id.logit_targets] == tokens == [t.vocab_idx for t in by_text.logit_targets]
    assert torch.equal(by_id.adjacency_matrix, by_text.adjacency_matrix)
    with pytest.raises(InputError, match="one token"):
        attribution_graph(sm, tc, PROMPT, attribution_targets=["ab"])


def test_prompt_ids_follow_circuit_tracer(sm):
    tok = sm.tokenizer
    bos = tok.bos_token_id
    assert prompt_ids(tok, "hi") == [bos] + tok("hi", add_special_tokens=False)["input_ids"]
    assert prompt_ids(tok, [bos, 40, 41]) == [bos, 40, 41]  # a special token already in front stays alone
    assert prompt_ids(tok, torch.tensor([[40, 41]])) == [bos, 40, 41]
    with pytest.raises(InputError):
        prompt_ids(tok, "")


def _graph(adj, n_features=1, n_pos=2, n_layers=1, probs=(1.0,)):
    return Graph(torch.arange(2, 2 + n_pos), torch.tensor([[0, 1, 7]] * n_features), torch.ones(n_features),
                 torch.arange(n_features), [LogitTarget(str(i), i) for i in range(len(probs))], torch.tensor(probs),
                 adj, n_layers=n_layers, vocab_size=100, scan="tiny", prompt_tokens=["<s>", "a"][:n_pos])


def test_prune_and_scores_on_known_graphs():
    # nodes: feature 0, errors 1-2, tokens 3-4, logit 5. token 4 -> feature (2), feature -> logit (3), error 2 -> logit (1)
    adj = torch.zeros(6, 6)
    adj[0, 4], adj[5, 0], adj[5, 2] = 2.0, 3.0, -1.0
    g = _graph(adj)
    replacement, completeness = compute_graph_scores(g)
    # influence: logit 1 -> feature 0.75, error 0.25 -> token 4 0.75: replacement = 0.75 / (0.75 + 0.25)
    assert replacement == pytest.approx(0.75)
    # non-error share: logit 0.75 (weight 1), feature 1.0 (weight 0.75), error 1 and tokens 1 (weight 0.25, 0.75)
    assert completeness == pytest.approx((0.75 * 1 + 1 * 0.75 + 1 * 0.25 + 1 * 0.75) / (1 + 0.75 + 0.25 + 0.75))
    nodes, edges, scores = prune_graph(g, node_threshold=0.7, edge_threshold=1.0)
    assert nodes.tolist() == [True, False, False, True, True, True]  # the error left: below 70% of the influence
    assert edges.nonzero().tolist() == [[0, 4], [5, 0]]
    assert scores[0] == pytest.approx(0.75 / 1.75) and scores.max() == pytest.approx(1.0)
    everything = prune_graph(g, node_threshold=1.0, edge_threshold=1.0)
    assert everything.node_mask.tolist() == [True, False, True, True, True, True]  # error 1 has no edge: dropped
    assert everything.edge_mask.sum() == 3
    for bad in (-0.1, 1.5):
        with pytest.raises(InputError, match="between 0.0 and 1.0"):
            prune_graph(g, node_threshold=bad)
    with pytest.raises(InputError, match="adjacency matrix"):
        _graph(torch.zeros(5, 5))


def test_frontend_file_is_valid_for_neuronpedia(sm, tmp_path):
    import jsonschema  # in the development lock (locks/venv.txt): the reference validator, never skipped
    tc = random_transcoders(sm, d_sae=32)
    graph = attribution_graph(sm, tc, PROMPT)
    path = graph.to_json(tmp_path / "my-graph.json")
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, graph_schema())  # the vendored schema, by the reference validator
    assert doc["metadata"]["slug"] == "my-graph" and doc["metadata"]["scan"] == tc.scan
    assert doc["metadata"]["prompt_tokens"] == graph.prompt_tokens
    nodes, edges, _ = prune_graph(graph)
    ids = {n["node_id"] for n in doc["nodes"]}
    kinds = {n["feature_type"] for n in doc["nodes"]}
    assert {"embedding", "logit"} <= kinds and len(kinds) >= 3  # and features or errors
    assert sum(n["feature_type"] == "embedding" for n in doc["nodes"]) == graph.n_pos
    assert all(e["source"] in ids and e["target"] in ids for e in doc["links"])
    assert len(doc["links"]) <= int(edges.sum())
    assert [n["is_target_logit"] for n in doc["nodes"] if n["feature_type"] == "logit"][0] is True
    graph.to_json(tmp_path / "second.json", scan="other")
    meta = json.loads((tmp_path / "graph-metadata.json").read_text())
    assert [m["slug"] for m in meta["graphs"]] == ["my-graph", "second"]
    doc["nodes"][0].pop("feature")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, graph_schema())
    with pytest.raises(InputError, match="scan="):
        Graph(**{**graph.__dict__, "scan": None}).to_json(tmp_path / "x.json")
    # the folder's graph-metadata.json is read back bounded: a deep one is refused, never overwritten
    deep = '{"graphs": ' + "[" * 100 + "]" * 100 + "}"
    (tmp_path / "graph-metadata.json").write_text(deep)
    with pytest.raises(InputError, match="nested at most 64 deep"):
        graph.to_json(tmp_path / "third.json")
    assert (tmp_path / "graph-metadata.json").read_text() == deep and not (tmp_path / "third.json").exists()


def test_refused_families_and_transcoders(sm):
    tc = random_transcoders(sm, d_sae=16)
    model, tok = tiny_model("gemma2", num_hidden_layers=3)
    gemma2 = steerkit.wrap(model, tok, name="tiny-gemma2")
    with pytest.raises(UnsupportedArchitectureError, match="sequential pre-norm"):
        attribution_graph(gemma2, random_transcoders(gemma2, d_sae=16), PROMPT)
    wrong_out = Transcoders(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, activation="jumprelu", threshold=tc.threshold,
                            output_hook="hook_resid_post")
    with pytest.raises(InputError, match="writing hook_mlp_out"):
        attribution_graph(sm, wrong_out, PROMPT)
    with pytest.raises(InputError, match="batch_size"):
        attribution_graph(sm, tc, PROMPT, batch_size=0)
    with pytest.raises(InputError, match="max_feature_nodes"):
        attribution_graph(sm, tc, PROMPT, max_feature_nodes=0)
    with pytest.raises(InputError, match="desired_logit_prob"):
        attribution_graph(sm, tc, PROMPT, desired_logit_prob=0.0)


# ---------------------------------------------------------------------------------------------- where it runs
class _Factories(TorchFunctionMode):
    """Records the tensor factories called from probes/attribution.py without ``device=``."""

    FACTORIES = {torch.zeros, torch.empty, torch.ones, torch.full, torch.arange, torch.tensor}

    def __init__(self):
        super().__init__()
        self.calls, self.unnamed = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES:
            caller = sys._getframe(1)
            if caller.f_code.co_filename == attribution.__file__:
                self.calls += 1
                if kwargs.get("device") is None:
                    self.unnamed.append(f"{func.__name__} at line {caller.f_lineno}")
        return func(*args, **kwargs)


def test_every_tensor_it_makes_names_its_device(sm):
    """A tensor made without device= lands on the default device (the CPU): on a GPU model it would be a mix of
    devices, or a silent copy. Every graph, full or limited, is built from tensors whose device is named."""
    tc = random_transcoders(sm, d_sae=32, activation="jumprelu", skip=True)
    watch = _Factories()
    with watch:
        attribution_graph(sm, tc, PROMPT, batch_size=16)
        attribution_graph(sm, tc, PROMPT, batch_size=16, max_feature_nodes=30, attribution_targets=["a"])
        attribution_graph(sm, random_transcoders(sm, d_sae=32, cross_layer=True), PROMPT, batch_size=16)
    assert watch.calls > 100 and watch.unnamed == []


def test_device_is_the_models_unless_asked(sm):
    tc = random_transcoders(sm, d_sae=32)
    assert attribution._device(sm, None) == sm.device
    default = attribution_graph(sm, tc, PROMPT)
    asked = attribution_graph(sm, tc, PROMPT, device="cpu")
    assert torch.equal(default.adjacency_matrix, asked.adjacency_matrix)
    for g in (default, asked):  # the graph comes back on the CPU, as circuit-tracer's adjacency does
        assert {t.device.type for t in (g.adjacency_matrix, g.active_features, g.activation_values,
                                        g.selected_features, g.logit_probabilities, g.input_tokens)} == {"cpu"}
    with pytest.raises(InputError, match="device="):
        attribution_graph(sm, tc, PROMPT, device="nowhere")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="device="):
            attribution_graph(sm, tc, PROMPT, device="cuda")


def test_no_process_wide_setting_is_touched(sm, monkeypatch):
    """No thread count, default device or dtype is changed, and no thread pool is made: a library call must not
    change how the rest of the process runs."""
    tc = random_transcoders(sm, d_sae=32)

    def refuse(*args, **kwargs):
        raise AssertionError("attribution_graph changed a process-wide setting")
    for name in ("set_num_threads", "set_num_interop_threads", "set_default_device", "set_default_dtype",
                 "set_flush_denormal"):
        monkeypatch.setattr(torch, name, refuse)
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "__init__", refuse)
    before = (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled())
    attribution_graph(sm, tc, PROMPT, batch_size=8)
    attribution_graph(sm, tc, PROMPT, batch_size=8, max_feature_nodes=20)
    assert (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()) == before


def test_progress_bar_and_verbose(sm, monkeypatch, capsys):
    tc = random_transcoders(sm, d_sae=32)
    bars = []

    class Bar(attribution.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.asked = kwargs
            bars.append(self)
    monkeypatch.setattr(attribution, "tqdm", Bar)
    graph = attribution_graph(sm, tc, PROMPT, max_feature_nodes=40, batch_size=8, verbose=True)
    assert len(bars) == 1 and bars[0].total == graph.n_features == 40 and bars[0].n == 40
    assert not bars[0].asked["disable"] and bars[0].asked["delay"] > 0  # shown once it takes longer than a moment
    err = capsys.readouterr().err
    assert "active features" in err and "40 features' rows" in err
    attribution_graph(sm, tc, PROMPT, progress=False)
    assert bars[1].asked["disable"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_equals_the_cpu(sm):
    """On a GPU model the graph is computed there (as circuit-tracer computes it) and equals the CPU's; device=
    computes it elsewhere; transcoders on the CPU (memory-mapped) or on the GPU."""
    tc = random_transcoders(sm, d_sae=48, activation="jumprelu", skip=True, seed=7)
    want = attribution_graph(sm, tc, PROMPT, batch_size=16)
    want_limited = attribution_graph(sm, tc, PROMPT, batch_size=16, max_feature_nodes=60)
    model, tok = tiny_circuit_llama(seed=3)
    gpu = steerkit.wrap(copy.deepcopy(model).to("cuda"), tok, name="tiny-circuit-llama")
    torch.cuda.reset_peak_memory_stats()
    for transcoders in (tc, tc.to("cuda")):
        got = attribution_graph(gpu, transcoders, PROMPT, batch_size=16)
        assert got.adjacency_matrix.device.type == "cpu"
        assert torch.equal(got.active_features, want.active_features)
        assert (got.adjacency_matrix - want.adjacency_matrix).abs().max() <= 1e-4 * want.adjacency_matrix.abs().max()
        limited = attribution_graph(gpu, transcoders, PROMPT, batch_size=16, max_feature_nodes=60)
        assert torch.equal(limited.selected_features, want_limited.selected_features)
    assert torch.cuda.max_memory_allocated() > 4 * want.adjacency_matrix.numel()  # the work ran on the GPU
    on_cpu = attribution_graph(gpu, tc, PROMPT, batch_size=16, device="cpu")
    assert (on_cpu.adjacency_matrix - want.adjacency_matrix).abs().max() <= 1e-4 * want.adjacency_matrix.abs().max()
    assert prune_graph(limited.to("cuda")).node_mask.device.type == "cuda"



def test_offloaded_rows_and_position_spans_keep_the_values(sm, tmp_path, monkeypatch):
    """A longer prompt whose features' decoder rows are padded in several position spans, and rows kept in a file
    (offload=): the same graph as in memory, its rows the reference's; no file is left behind."""
    tc = random_transcoders(sm, d_sae=48, activation="jumprelu", skip=True, seed=8)
    prompt = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    want = attribution_graph(sm, tc, prompt, batch_size=16, max_feature_nodes=50)
    monkeypatch.setattr(attribution, "SPAN", 3)
    monkeypatch.setattr(graph_rows, "CHUNK_ROWS", 7)  # rows read back from the file a few at a time
    spans = attribution_graph(sm, tc, prompt, batch_size=16, max_feature_nodes=50)
    offloaded = attribution_graph(sm, tc, prompt, batch_size=16, max_feature_nodes=50, offload=tmp_path)
    assert want.n_pos > 3 * 3
    for g in (spans, offloaded):
        assert torch.equal(g.selected_features, want.selected_features)
        assert torch.allclose(g.adjacency_matrix, want.adjacency_matrix, atol=1e-6)
    rows = [0, 17, 49, offloaded.adjacency_matrix.shape[0] - 1]
    ref = reference_rows(sm, tc, offloaded, rows)
    assert torch.allclose(offloaded.adjacency_matrix[rows], ref, atol=1e-4 * float(ref.abs().max()))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match="offload="):
        attribution_graph(sm, tc, prompt, max_feature_nodes=50, offload=tmp_path / "missing")
