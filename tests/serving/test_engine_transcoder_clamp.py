"""A stored transcoder clamp (a supernode :class:`~steerkit.vectors.LatentClamp` over several blocks) in an engine's
steering, on a model laid out as a vLLM worker's (tests/support/tiny_models.py: ``pair_engine_model``, whose tokens
do not mix, so each row has a reference of its own): the MLP's input is a read-only site (``blocks.{l}.mlp.hook_in``,
a forward pre-hook), the host plan stores it per request and the MLP's output gets exactly ``(f' - f) @ W_dec``;
requests sharing one spec in a step each read their own rows; a compiled graph keeps the read; an engine that
replays CUDA graphs refuses the clamp up front."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from steerkit.kernels.slots import SlotShape
from steerkit.loading.adapters import vllm_sites
from steerkit.serving.engine import EngineSteering, RequestSteerings, graph_refusal
from steerkit.serving.plan import slot_capacity
from steerkit.serving.record_worker import record_sites
from steerkit.serving.spec import SpecError, parse_spec, resolve
from steerkit.vectors import LatentClamp, Store, Transcoders
from tiny_models import pair_engine_model

D, L, VOCAB, D_SAE = 64, 3, 97, 32


def _transcoders(activation: str, seed: int) -> Transcoders:
    """Random transcoders for the pair model's blocks; large decoder rows, so a clamp moves the stream."""
    g = torch.Generator().manual_seed(seed)
    enc = [torch.randn(D_SAE, D, generator=g) for _ in range(L)]
    b_enc = [0.2 * torch.randn(D_SAE, generator=g) for _ in range(L)]
    dec = [torch.randn(D_SAE, D, generator=g) for _ in range(L)]
    b_dec = [0.1 * torch.randn(D, generator=g) for _ in range(L)]
    return Transcoders(enc, b_enc, dec, b_dec, activation=activation, k=6 if activation == "topk" else None)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store with a TopK supernode (blocks 0 and 2, value 3), the same at generated positions only, and a ReLU
    ablation (block 1): ``(store, transcoders, {name: spec text})``."""
    topk, relu = _transcoders("topk", 1), _transcoders("relu", 2)
    store = Store(tmp_path_factory.mktemp("store"))
    parts = {0: [1, 5], 2: [3]}
    refs = {"node": store.save("node", LatentClamp.of_transcoders(topk, parts, value=3.0)),
            "node-gen": store.save("node-gen", LatentClamp.of_transcoders(topk, parts, value=3.0,
                                                                           positions="generated")),
            "ablate": store.save("ablate", LatentClamp.of_transcoders(relu, {1: [0, 2, 4]}, scale=0.0))}
    spec = {name: json.dumps({"artifacts": [{"ref": ref, "scale": 1.0}]}) for name, ref in refs.items()}
    spec["node-half"] = json.dumps({"artifacts": [{"ref": refs["node"], "scale": 0.5}]})
    return store, {"node": topk, "node-gen": topk, "node-half": topk, "ablate": relu}, spec


def _engine(store, seed: int = 0, graphs: bool = False):
    model, facts = pair_engine_model(D, L, VOCAB, seed=seed)
    cap = {**slot_capacity(None), "configs": 32, "basis": 4}
    return model, EngineSteering(model, facts, max_tokens=32, capacity=cap, store=store, graphs=graphs)


def _reference(tc: Transcoders, parts: dict, value, scale, ids: torch.Tensor, steered: torch.Tensor):
    """The pair model on ``ids`` with the two-site formula written out with plain hooks: at block ``l``'s MLP the
    features ``parts[l]`` of its input are set to ``value`` (or ``scale`` times themselves) on the ``steered``
    rows, and ``(f' - f) @ W_dec`` is added to its output."""
    model, _ = pair_engine_model(D, L, VOCAB)
    seen: dict = {}
    handles = []
    for l, feats in parts.items():
        mlp = model.model.layers[l].mlp
        handles.append(mlp.register_forward_pre_hook(lambda _m, args, l=l: seen.__setitem__(l, args[0].clone())))

        def add(_m, _args, out, l=l, feats=feats):
            f = tc.encode_layer(seen[l], l)[:, feats]
            new = torch.full_like(f, value) if value is not None else f * scale
            return out + steered[:, None] * ((new - f) @ tc.W_dec[l][feats])
        handles.append(mlp.register_forward_hook(add))
    with torch.no_grad():
        out = model(ids)
    for h in handles:
        h.remove()
    return out


PARTS = {"node": ({0: [1, 5], 2: [3]}, 3.0, None), "node-half": ({0: [1, 5], 2: [3]}, 1.5, None),
         "node-gen": ({0: [1, 5], 2: [3]}, 3.0, None), "ablate": ({1: [0, 2, 4]}, None, 0.0)}


def test_the_mlp_input_is_a_read_only_site_of_the_engine_not_of_the_slots_or_the_recorder():
    model, facts = pair_engine_model(D, L, VOCAB)
    sites = vllm_sites(model)
    for l in range(L):
        assert sites[f"blocks.{l}.mlp.hook_in"] == (model.model.layers[l].mlp, "in")
    engine = EngineSteering(model, facts, max_tokens=8, capacity={**slot_capacity(None), "configs": 4}, store=None)
    assert engine.read_sites == [f"blocks.{l}.mlp.hook_in" for l in range(L)]
    assert not set(engine.read_sites) & set(engine.slots.sites) and not set(engine.read_sites) & set(record_sites(model))
    assert set(engine.slots.sites) | set(engine.read_sites) == set(sites)
    engine.close()


def test_each_request_gets_exactly_the_two_site_formula_on_its_own_rows(stored):
    """One host step: the supernode prefilled for two requests with the same spec (each must read its own MLP
    inputs), the same at scale 0.5, the ablation, an unsteered request, and the generated-only clamp on a prompt
    chunk and on a generated token; then a decoding step."""
    store, tcs, spec = stored
    model, engine = _engine(store)
    plain, _ = pair_engine_model(D, L, VOCAB)
    steps = [  # (request, start, end, first position, prompt length, spec name or None)
        [("a", 0, 4, 0, 4, "node"), ("b", 4, 7, 0, 3, "node"), ("h", 7, 9, 0, 2, "node-half"),
         ("z", 9, 12, 0, 3, "ablate"), ("u", 12, 14, 0, 2, None), ("g", 14, 16, 0, 2, "node-gen"),
         ("g2", 16, 17, 5, 5, "node-gen")],
        [("a", 0, 1, 4, 4, "node"), ("b", 1, 2, 3, 3, "node"), ("z", 2, 3, 3, 3, "ablate"), ("u", 3, 4, 2, 2, None)],
    ]
    for k, step in enumerate(steps):
        ids = torch.randint(0, VOCAB, (step[-1][2],), generator=torch.Generator().manual_seed(k))
        reqs = [(r, a, b, np.arange(p, p + b - a), n, spec[name]) for r, a, b, p, n, name in step if name]
        engine.begin_step(reqs, total=ids.shape[0])
        assert engine.plan is not None  # the slots refuse a latent clamp: the host path steers the step
        with torch.no_grad():
            got, base = model(ids), plain(ids)
        engine.end_step()
        for r, a, b, p, n, name in step:
            if name is None:
                assert torch.equal(got[a:b], base[a:b]), r
                continue
            parts, value, scale = PARTS[name]
            steered = torch.ones(b - a) if name != "node-gen" else torch.tensor(np.arange(p, p + b - a) >= n).float()
            want = _reference(tcs[name], parts, value, scale, ids[a:b], steered)
            torch.testing.assert_close(got[a:b], want, atol=1e-4, rtol=1e-4, msg=f"request {r}")
            assert torch.equal(got[a:b], base[a:b]) == (not bool(steered.any())), r  # every clamp moves its rows
        for name in spec:  # nothing stored crosses into the next step
            res = engine.steerings.get(spec[name])
            assert len(res.compiled.reads) == 0
    engine.close()


def test_a_compiled_graph_keeps_the_read_and_runs_the_clamp_on_the_host(stored):
    """torch.compile of the engine's model (fullgraph): the read operator stays in the graph, the clamp steps
    equal the eager engine's, and a slots step and an unsteered step after them reuse the one graph."""
    from torch._dynamo.utils import counters
    store, _, spec = stored
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]  # other tests of the process may have compiled
    model, engine = _engine(store)
    ref, eager = _engine(store)
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    add = json.dumps({"ops": [{"op": "add", "layers": [1], "vector": [0.5] * D}]})
    steps = [[("a", 0, 4, 0, 4, spec["node"]), ("z", 4, 6, 0, 2, spec["ablate"])], [("c", 0, 3, 0, 3, add)], [],
             [("a", 0, 1, 4, 4, spec["node"]), ("h", 1, 6, 0, 5, spec["node-half"])]]
    for k, step in enumerate(steps):
        ids = torch.randint(0, VOCAB, (max([b for _, _, b, *_ in step] or [3]),),
                            generator=torch.Generator().manual_seed(k))
        outs = []
        for m, e in ((compiled, engine), (ref, eager)):
            e.begin_step([(r, a, b, np.arange(p, p + b - a), n, raw) for r, a, b, p, n, raw in step], total=len(ids))
            with torch.no_grad():
                outs.append(m(ids))
            e.end_step()
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1
    engine.close()
    eager.close()


def test_cuda_graph_engines_refuse_the_clamp_and_an_unreadable_input_is_refused(stored):
    store, _, spec = stored
    _, facts = pair_engine_model(D, L, VOCAB)
    res = RequestSteerings(facts, store=store, check=False).get(spec["node"])
    assert set(res.compiled.programs) == {"blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out", "blocks.2.mlp.hook_in",
                                          "blocks.2.hook_mlp_out"}
    why = graph_refusal(res.compiled, SlotShape(D))
    assert why is not None and "'latent'" in why and "hook_mlp_out" in why
    # an engine that replays CUDA graphs never runs such a step (its front end refused it): unsteered, not wrong
    model, engine = _engine(store, graphs=True)
    plain, _ = pair_engine_model(D, L, VOCAB)
    ids = torch.arange(4)
    engine.begin_step([("a", 0, 4, np.arange(4), 4, spec["node"])], total=4)
    assert engine.plan is None
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))
    engine.end_step()
    engine.close()
    # a transcoder reading a site the plugin cannot hook is refused when the request is resolved
    g = torch.Generator().manual_seed(0)
    mid = Transcoders([torch.randn(8, D, generator=g) for _ in range(L)], [torch.zeros(8)] * L,
                      [torch.randn(8, D, generator=g) for _ in range(L)], [torch.zeros(D)] * L,
                      input_hook="ln2.hook_normalized")
    ref = store.save("mid", LatentClamp.of_transcoders(mid, {1: [2]}, value=1.0))
    with pytest.raises(SpecError, match="read a transcoder's input at .*found 'blocks.1.ln2.hook_normalized'"):
        resolve(parse_spec({"artifacts": [{"ref": ref}]}), store=store, facts=facts, check=False)
