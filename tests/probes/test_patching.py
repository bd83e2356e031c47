"""Activation patching, attribution patching, the logit lens and direct logit attribution
(:mod:`steerkit.probes.patching`, :mod:`steerkit.probes.lens`).

On the real default model (SmolLM2-135M-Instruct, float32) and the IOI pair "When Mary and John
went to the store, John gave a drink to" (clean) / the names swapped (corrupted), metric the logit
difference ``" Mary" - " John"`` at the last position (clean about +6.1, corrupted about -6.5):

The shared grids (module fixtures) cover every third layer and the last (11 of 30) to keep the run short.

- batched patching (up to 32 patched runs per pass, each started at its block and first position and
  packed end to end) equals one patch per pass (``batch_size=1``) and full forward passes
  (``reuse=False``) within 1e-5 in logit units (the values reach 6.5; measured 0 against full passes:
  the packed attention runs as a batch of whole sequences, :mod:`steerkit.hooks.segments`);
- TransformerLens sanity checks: patching every position of layer 0's resid_pre restores the clean
  metric; a position whose token is the same in both prompts, patched at layer 0, leaves the
  corrupted metric; the last layer's resid_post at the last position restores the clean metric;
- TransformerLens 4's own ``transformer_lens.patching.get_act_patch_resid_pre`` and
  ``get_act_patch_attn_head_out_all_pos`` run on the TransformerLens bridge of the same model give
  the same values within 1e-4 (logit units; measured 1.6e-5 and 1.4e-5 over the full 30 x 14 and
  30 x 9 grids: the bridge runs eager attention, the HF backend SDPA). To keep the run short they
  run on a subset of the cells through their ``index_df`` argument;
- attribution patching correlates with activation patching (Pearson r over the grid of
  ``values - corrupted_metric``; measured 0.74 on resid_pre and 0.99 on z heads over the shared
  layers, 0.74 and 0.94 over all 30 layers);
- direct logit attribution's parts sum to the logit difference (this model's final RMSNorm and
  unembedding have no bias, so the bias term is 0); the logit lens at the last layer is the model's
  own logits.
Error messages and JSON round trips also run on a tiny random model (fast).
"""
from __future__ import annotations

import math

import pytest
import torch

import steerkit
from steerkit import Intervention
from steerkit.errors import InputError, SteerkitError, UnsupportedArchitectureError
from steerkit.model import Tokens
from steerkit.probes import (DLAResult, LensResult, PatchingResult, activation_patching, attribution_patching,
                             direct_logit_attribution, logit_diff_metric, logit_lens)

from tiny_models import tiny_model

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When John and Mary went to the store, Mary gave a drink to"
TL_TOL = 1e-4
#: the layers the shared grids cover (every third and the last), to keep the file's run time short
LAYERS = [*range(0, 30, 3), 29]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


# ----------------------------------------------------------------------------- shared results
@pytest.fixture(scope="module")
def metric(default_model):
    return logit_diff_metric(default_model, " Mary", " John")


@pytest.fixture(scope="module")
def resid_grid(default_model, metric) -> PatchingResult:
    return activation_patching(default_model, CLEAN, CORRUPTED, metric, "resid_pre", layers=LAYERS, progress=False)


@pytest.fixture(scope="module")
def z_grid(default_model, metric) -> PatchingResult:
    return activation_patching(default_model, CLEAN, CORRUPTED, metric, "z", layers=LAYERS, progress=False)


@pytest.fixture(scope="module")
def bridge(default_model):
    pytest.importorskip("transformer_lens")
    sm = default_model
    return steerkit.wrap(sm.hf_model, sm.tokenizer, name=sm.name, backend="tlens").backend.bridge


# ----------------------------------------------------------------------------- activation patching
@pytest.mark.slow
def test_grid_shape_labels_and_metrics(sm, resid_grid, metric):
    r = resid_grid
    toks = sm.tokenize([CLEAN], chat=False)
    n_pos = toks.input_ids.shape[1]
    assert sm.n_layers == 30 and r.values.shape == (len(LAYERS), n_pos) and r.axes == ("layer", "pos")
    assert r.layers == LAYERS and r.positions == list(range(n_pos)) and r.heads is None
    assert r.tokens == [sm.tokenizer.decode([int(i)]) for i in toks.input_ids[0]]
    assert float(metric(sm.forward(toks))) == pytest.approx(r.clean_metric, abs=1e-5)
    assert r.clean_metric > 3 and r.corrupted_metric < -3  # the model does IOI on this pair


@pytest.mark.slow
def test_batched_equals_one_patch_per_forward(sm, resid_grid, metric):
    """One patch per pass (``batch_size=1``) equals the same grid in full passes of one row within 1e-5,
    and the batched grid within 2e-5: a pass of one short segment multiplies one or two rows, which BLAS
    computes as a matrix-vector product that rounds otherwise (measured 1.1e-5; full passes of one row
    differ from 32-row passes by 3.8e-6 in the unembedding for the same reason)."""
    layers = [0, sm.n_layers - 1]
    rows = [LAYERS.index(l) for l in layers]
    pos = [0, 1, 2, 3, 9, 12, 13]  # the three name positions, shared tokens, the last
    kw: dict = dict(layers=layers, positions=pos, batch_size=1, progress=False)
    one = activation_patching(sm, CLEAN, CORRUPTED, metric, "resid_pre", **kw)
    assert one.layers == layers and one.positions == pos
    one_full = activation_patching(sm, CLEAN, CORRUPTED, metric, "resid_pre", reuse=False, **kw)
    err = float((one.values - one_full.values).abs().max())
    assert err <= 1e-5, f"batch_size=1, packed vs full passes: max |diff| = {err:.3g}"
    err = float((one.values - resid_grid.values[rows][:, pos]).abs().max())
    assert err <= 2e-5, f"batched vs batch_size=1: max |diff| = {err:.3g}"
    # an uneven last chunk (4 rows per pass over 2 x 3 patches) and a subset of positions
    odd = activation_patching(sm, CLEAN, CORRUPTED, metric, "resid_pre", layers=layers, positions=[1, 3, -1],
                              batch_size=4, progress=False)
    assert odd.positions == [1, 3, 13]
    assert float((odd.values - resid_grid.values[rows][:, [1, 3, 13]]).abs().max()) <= 1e-5


@pytest.mark.slow
def test_prefix_reuse_equals_full_passes(sm, resid_grid, z_grid, metric):
    """The default grids start each patched run at its block and position (packed); full forward passes
    (``reuse=False``) give the same values. Tolerance 1e-5 in logit units (values of magnitude up to 6.5;
    measured 0 here and over the full 30 x 21 grid of benchmarks/bench_patching.py: each packed segment's
    attention runs as one whole sequence of a batch, as in a full pass)."""
    layers = [0, 12, sm.n_layers - 1]
    rows = [LAYERS.index(l) for l in layers]
    full = activation_patching(sm, CLEAN, CORRUPTED, metric, "resid_pre", layers=layers, reuse=False, progress=False)
    err = float((full.values - resid_grid.values[rows]).abs().max())
    assert err <= 1e-5, f"resid_pre: max |packed - full| = {err:.3g}"
    zfull = activation_patching(sm, CLEAN, CORRUPTED, metric, "z", layers=layers, reuse=False, progress=False)
    err = float((zfull.values - z_grid.values[rows]).abs().max())
    assert err <= 1e-5, f"z: max |packed - full| = {err:.3g}"
    assert full.corrupted_metric == pytest.approx(resid_grid.corrupted_metric, abs=1e-5)


@pytest.mark.slow
def test_transformer_lens_sanity_checks(sm, resid_grid, metric):
    clean = sm.tokenize([CLEAN], chat=False)
    corrupted = sm.tokenize([CORRUPTED], chat=False)
    with sm.record("blocks.0.hook_resid_pre") as cache:
        sm.forward(clean)
    with sm.steer(Intervention.patch("blocks.0.hook_resid_pre", cache["blocks.0.hook_resid_pre"][0])):
        restored = float(metric(sm.forward(corrupted)))
    assert restored == pytest.approx(resid_grid.clean_metric, abs=1e-5)
    same = (clean.input_ids[0] == corrupted.input_ids[0]).tolist()
    assert 0 < sum(same) < len(same)
    for p, s in enumerate(same):  # layer 0 holds only the token: a shared token changes nothing
        if s:
            assert float(resid_grid.values[0, p]) == pytest.approx(resid_grid.corrupted_metric, abs=1e-5)
    last = activation_patching(sm, CLEAN, CORRUPTED, metric, "resid_post", layers=[-1], positions=[-1], progress=False)
    assert last.values.shape == (1, 1) and float(last.values[0, 0]) == pytest.approx(last.clean_metric, abs=1e-4)
    # the late layers' last position carries the answer: patching it restores most of the gap
    assert float(resid_grid.normalized().values[-1, -1]) > 0.8


@pytest.mark.slow
@pytest.mark.backends
def test_matches_transformer_lens_patching(sm, resid_grid, z_grid, metric, bridge):
    pd = pytest.importorskip("pandas")
    from transformer_lens import patching

    clean = sm.tokenize([CLEAN], chat=False).input_ids
    corrupted = sm.tokenize([CORRUPTED], chat=False).input_ids
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(clean)
        # layer 0 at every position, later layers at the name positions and the last
        cells = [(0, p) for p in range(clean.shape[1])] + [(l, p) for l in (9, 18, sm.n_layers - 1)
                                                           for p in (1, 3, 9, 13)]
        df = pd.DataFrame(cells, columns=["layer", "pos"])
        theirs = patching.get_act_patch_resid_pre(bridge, corrupted, cache, metric, index_axis_names=None,
                                                  index_df=df)
        zlayers = [15, 21, sm.n_layers - 1]
        dfz = pd.DataFrame([(l, h) for l in zlayers for h in range(sm.n_heads)], columns=["layer", "head"])
        theirs_z = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupted, cache, metric,
                                                                index_axis_names=None, index_df=dfz)
    ours = torch.stack([resid_grid.values[LAYERS.index(l), p] for l, p in cells])
    err = float((ours - theirs.cpu().float()).abs().max())
    assert err <= TL_TOL, f"resid_pre: max |steerkit - TransformerLens| = {err:.3g}"
    assert z_grid.values.shape == (len(LAYERS), sm.n_heads) and z_grid.axes == ("layer", "head")
    err_z = float((z_grid.values[[LAYERS.index(l) for l in zlayers]].flatten() - theirs_z.cpu().float()).abs().max())
    assert err_z <= TL_TOL, f"z: max |steerkit - TransformerLens| = {err_z:.3g}"


@pytest.mark.slow
def test_head_and_neuron_sites(sm, z_grid, metric):
    zp = activation_patching(sm, CLEAN, CORRUPTED, metric, "z_pos", layers=[20], positions=[-1], heads=[0, 4],
                             progress=False)
    assert zp.values.shape == (1, 1, 2) and zp.axes == ("layer", "pos", "head") and zp.heads == [0, 4]
    one = activation_patching(sm, CLEAN, CORRUPTED, metric, "z", layers=[21], heads=[4], progress=False)
    assert float(one.values[0, 0]) == pytest.approx(float(z_grid.values[LAYERS.index(21), 4]), abs=1e-5)
    nr = activation_patching(sm, CLEAN, CORRUPTED, metric, "mlp_post", layers=[0], neurons=[5, 7], progress=False)
    assert nr.values.shape == (1, 2) and nr.axes == ("layer", "neuron") and nr.neurons == [5, 7]


# ----------------------------------------------------------------------------- attribution patching
@pytest.mark.slow
def test_attribution_correlates_with_activation_patching(sm, resid_grid, z_grid, metric):
    no_grad_before = [p.grad is None for p in sm.hf_model.parameters()]
    attr = attribution_patching(sm, CLEAN, CORRUPTED, metric, "resid_pre", layers=LAYERS, progress=False)
    assert attr.method == "attribution" and attr.values.shape == resid_grid.values.shape
    assert attr.corrupted_metric == pytest.approx(resid_grid.corrupted_metric, abs=1e-4)
    assert attr.clean_metric == pytest.approx(resid_grid.clean_metric, abs=1e-5)
    r = _pearson(attr.values, resid_grid.values - resid_grid.corrupted_metric)
    assert r > 0.6, f"Pearson r(attribution, activation) on resid_pre = {r:.3f}"
    # a shared token at layer 0 is the same in both runs: its attribution is exactly 0
    same = (sm.tokenize([CLEAN], chat=False).input_ids[0] == sm.tokenize([CORRUPTED], chat=False).input_ids[0])
    assert bool((attr.values[0][same] == 0).all())
    attr_z = attribution_patching(sm, CLEAN, CORRUPTED, metric, "z", layers=LAYERS, progress=False)
    rz = _pearson(attr_z.values, z_grid.values - z_grid.corrupted_metric)
    assert rz > 0.85, f"Pearson r(attribution, activation) on z = {rz:.3f}"
    assert sm.hook_count() == 0
    assert [p.grad is None for p in sm.hf_model.parameters()] == no_grad_before  # no .grad left on the model


# ----------------------------------------------------------------------------- lens and DLA
@pytest.mark.slow
def test_dla_parts_sum_to_the_logit_difference(sm, resid_grid):
    d = direct_logit_attribution(sm, CLEAN, " Mary", " John")
    assert d.position == 13 and d.answer == " Mary" and d.wrong == " John"
    assert d.attn.shape == (sm.n_layers,) and d.mlp.shape == (sm.n_layers,)
    assert d.heads.shape == (sm.n_layers, sm.n_heads)
    assert d.logit_diff == pytest.approx(resid_grid.clean_metric, abs=1e-4)
    assert d.bias == 0.0  # RMSNorm without bias, lm_head without bias
    assert abs(d.error) < 1e-4 * max(1.0, abs(d.logit_diff)), d
    assert float((d.heads.sum(1) + d.attn_bias - d.attn).abs().max()) < 1e-5
    assert len(d.components()) == 1 + 2 * sm.n_layers
    # without a wrong answer: the answer's own logit
    one = direct_logit_attribution(sm, CLEAN, " Mary")
    logit = float(sm.forward(sm.tokenize([CLEAN], chat=False))[0, -1, one.answer_id])
    assert one.logit_diff == pytest.approx(logit, abs=1e-4) and abs(one.error) < 1e-4 * max(1.0, abs(logit))


@pytest.mark.slow
def test_logit_lens_last_layer_is_the_models_logits(sm):
    lens = logit_lens(sm, CLEAN, positions=None, top_k=3, layers=[0, 15, -1])
    logits = sm.forward(sm.tokenize([CLEAN], chat=False))[0]
    assert lens.layers == [0, 15, sm.n_layers - 1]
    assert lens.logits is not None and lens.logits.shape == (3, logits.shape[0], logits.shape[1])
    err = float((lens.logits[-1] - logits).abs().max())
    assert err <= 1e-4 * float(logits.abs().max()), err
    assert lens.top_ids[-1, :, 0].tolist() == logits.argmax(-1).tolist()
    assert lens.top_ids.shape == (3, logits.shape[0], 3)
    last = logit_lens(sm, CLEAN, layers=[-1])
    assert last.positions == [13] and last.layers == [sm.n_layers - 1]
    assert last.top_tokens[0][0][0] == sm.tokenizer.decode([int(logits[-1].argmax())])
    assert lens.prob_of(sm, " Mary").shape == (3, logits.shape[0])


# ----------------------------------------------------------------------------- storage and plots
@pytest.mark.slow
def test_json_round_trip_and_plots(sm, resid_grid, z_grid, tmp_path):
    go = pytest.importorskip("plotly.graph_objects")
    for res in (resid_grid, z_grid, resid_grid.normalized()):
        back = PatchingResult.from_json(res.to_json())
        assert torch.equal(back.values, res.values)
        for f in ("hook", "method", "layers", "positions", "heads", "tokens", "clean_metric", "corrupted_metric",
                  "neurons", "is_normalized"):
            assert getattr(back, f) == getattr(res, f), f
    res = resid_grid
    res.to_json(tmp_path / "p.json")
    assert torch.equal(PatchingResult.from_json(tmp_path / "p.json").values, res.values)
    n = res.normalized()
    assert n.is_normalized and n.normalized() is n
    assert float(n.values[0, 0]) == pytest.approx(0.0, abs=1e-6)  # a shared token: the corrupted metric
    fig = res.plot()
    assert isinstance(fig, go.Figure) and fig.data[0].type == "heatmap"
    assert len(fig.data[0].x) == len(res.positions) and "'" in fig.data[0].x[1]  # token labels
    assert len(set(fig.data[0].x)) == len(res.positions)  # repeated tokens stay distinct columns
    assert list(fig.data[0].y) == [f"L{l}" for l in res.layers]
    fz = z_grid.plot()
    assert list(fz.data[0].x) == [f"H{h}" for h in range(sm.n_heads)]
    d = direct_logit_attribution(sm, CLEAN, " Mary", " John")
    db = DLAResult.from_json(d.to_json())
    assert db.to_json() == d.to_json() and db.error == d.error
    assert isinstance(d.plot(), go.Figure) and d.plot("heads").data[0].type == "heatmap"
    lens = logit_lens(sm, CLEAN, positions=[-2, -1])
    lb = LensResult.from_json(lens.to_json())
    assert torch.equal(lb.top_ids, lens.top_ids) and torch.equal(lb.top_probs, lens.top_probs)
    assert lb.top_tokens == lens.top_tokens and lb.logits is None
    assert lens.plot().data[0].type == "heatmap"


# ----------------------------------------------------------------------------- errors (tiny model)
def test_tiny_grids_and_round_trip(tiny):
    met = logit_diff_metric(tiny, "a", "b")
    for hook, shape in [("resid_pre", (2, 5)), ("resid_mid", (2, 5)), ("attn_out", (2, 5)), ("mlp_out", (2, 5)),
                        ("resid_post", (2, 5)), ("z", (2, 4)), ("z_pos", (2, 5, 4)), ("mlp_post", (2, 5))]:
        r = activation_patching(tiny, "hello", "hallo", met, hook, batch_size=3, progress=False)
        r1 = activation_patching(tiny, "hello", "hallo", met, hook, batch_size=1, progress=False)
        a = attribution_patching(tiny, "hello", "hallo", met, hook, progress=False)
        assert r.values.shape == shape == a.values.shape, hook
        assert float((r.values - r1.values).abs().max()) <= 1e-5, hook
        back = PatchingResult.from_json(a.to_json())
        assert torch.equal(back.values, a.values) and back.method == "attribution"
        assert r.plot().data[0].type == "heatmap"
    assert tiny.hook_count() == 0
    assert all(p.grad is None for p in tiny.hf_model.parameters())


def test_tiny_dla_and_lens(tiny):
    d = direct_logit_attribution(tiny, "hello world", "a", "b")
    assert abs(d.error) < 1e-5 and math.isfinite(d.logit_diff)
    lens = logit_lens(tiny, "hello world", positions=None)
    logits = tiny.forward(tiny.tokenize(["hello world"], chat=False))[0]
    assert float((lens.logits[-1] - logits).abs().max()) < 1e-5


@pytest.mark.parametrize("arch", ["olmo2", "gemma2"])
def test_dla_refuses_post_norm_families(arch):
    model, tok = tiny_model(arch)
    sm = steerkit.wrap(model, tok, name=f"tiny-{arch}")
    with pytest.raises(UnsupportedArchitectureError, match="output projection"):
        direct_logit_attribution(sm, "hello", "a", "b")
    lens = logit_lens(sm, "hello")  # the lens still holds: it is the model's own final computation
    assert float((lens.logits[-1, 0] - sm.forward(sm.tokenize(["hello"], chat=False))[0, -1]).abs().max()) < 1e-5


def test_error_messages(tiny):
    met = logit_diff_metric(tiny, "a", "b")

    def raises(match, fn, *a, exc=InputError, **kw):
        with pytest.raises(exc, match=match) as e:
            fn(tiny, *a, **kw)
        assert isinstance(e.value, SteerkitError)

    raises("same number of tokens, found 5 and 6", activation_patching, "hello", "hallo!", met)
    raises("same number of tokens", attribution_patching, "hello", "hi", met)
    raises(r"expected hook in \('resid_pre'", activation_patching, "hello", "hallo", met, "resid")
    raises("non-empty string", activation_patching, "", "hallo", met)
    raises("at least one", activation_patching, [], "hallo", met)
    raises("ONE prompt", activation_patching, tiny.tokenize(["ab", "cd"], chat=False), "hallo", met)
    raises("without padding", activation_patching, Tokens(torch.tensor([[0, 50, 51]]), torch.tensor([[0, 1, 1]])),
           "hal", met)
    raises("token ids", activation_patching, torch.tensor([0.5, 1.0]), "ha", met)
    raises("batch_size as a positive int", activation_patching, "hello", "hallo", met, batch_size=0)
    raises("heads= only with hook='z'", activation_patching, "hello", "hallo", met, "resid_pre", heads=[0])
    raises("positions=None with hook='z'", activation_patching, "hello", "hallo", met, "z", positions=[0])
    raises("neurons= only with hook='mlp_post'", activation_patching, "hello", "hallo", met, "resid_pre", neurons=[0])
    raises(r"layers in -2\.\.1", activation_patching, "hello", "hallo", met, layers=[2])
    raises(r"positions in -5\.\.4", activation_patching, "hello", "hallo", met, positions=[5])
    raises("distinct", activation_patching, "hello", "hallo", met, positions=[0, -5])
    raises("at least one position", activation_patching, "hello", "hallo", met, positions=[])
    raises(r"heads in -4\.\.3", activation_patching, "hello", "hallo", met, "z", heads=[4])
    raises("scalar tensor, found shape", activation_patching, "hello", "hallo", lambda lg: lg[0, -1])
    raises("depend on the logits", attribution_patching, "hello", "hallo", lambda lg: torch.tensor(1.0))
    raises("one token, found 2", logit_diff_metric, "ab", "c")
    raises(r"token id in 0\.\.255", logit_diff_metric, 256, 1)
    raises("one token", direct_logit_attribution, "hello", "ab")
    raises(r"position in -5\.\.4", direct_logit_attribution, "hello", "a", position=9)
    raises("top_k as a positive int", logit_lens, "hello", top_k=0)
    with pytest.raises(InputError, match="format 'steerkit.patching/1'"):
        PatchingResult.from_json('{"format": "other"}')
    with pytest.raises(InputError, match="does not parse"):
        PatchingResult.from_json("{not json")
    with pytest.raises(InputError, match="malformed"):
        PatchingResult.from_json('{"format": "steerkit.patching/1", "values": []}')
    with pytest.raises(InputError, match="path to a file"):
        DLAResult.from_json("missing.json")
    same = activation_patching(tiny, "hello", "hello", met, layers=[0], positions=[0], progress=False)
    with pytest.raises(InputError, match="different clean and corrupted metrics"):
        same.normalized()
