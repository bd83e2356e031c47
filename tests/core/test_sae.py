"""Sparse autoencoders: steerkit's own encode / decode of every architecture, the sae-lens, sparsify and steerkit
formats (round trips, every malformed folder), the model check, and sparsify's own ``SparseCoder`` on the same
weights (sae-lens, which cannot live in this environment, is checked by tests/integration/test_sae_lens.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import steerkit
from steerkit.sae import (SAEFormatError, SAEWeights, detect_format, read_sae_folder, site_of_hook, sparsify_sites,
                          write_saelens, write_sparsify)
from steerkit.vectors import (SAE, ArtifactFormatError, ModelMismatchError, Provenance, SteeringVector, Store,
                              VectorsError, save_artifact)
from steerkit.vectors.artifacts import payload_to_artifact
from sae_weights import rel
from tiny_models import tiny_model

D_IN, D_SAE, K = 16, 64, 6


def weights(arch: str = "relu", seed: int = 0, *, d_out: int = D_IN, transcoder: bool = False, skip: bool = False,
            **options) -> SAEWeights:
    """A random SAE of ``arch`` whose latents fire on a share of random inputs."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale
    extra: dict = {"relu": {}, "topk": {"k": K}, "jumprelu": {"threshold": torch.rand(D_SAE, generator=g) * 0.4},
                   "gated": {"b_mag": r(D_SAE), "r_mag": r(D_SAE)}}[arch]
    return SAEWeights(r(D_IN, D_SAE), r(D_SAE), r(D_SAE, d_out), r(d_out), architecture=arch,
                      W_skip=r(D_IN, d_out) if skip else None, transcoder=transcoder,
                      apply_b_dec_to_input=options.pop("apply_b_dec_to_input", not transcoder), **extra, **options)


def inputs(seed: int = 1, rows: int = 12, width: int = D_IN) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2 + 0.3


VARIANTS = {
    "relu": {}, "jumprelu": {}, "topk": {}, "gated": {},
    "relu-layer_norm": {"normalize_activations": "layer_norm"},
    "topk-constant_norm_rescale": {"normalize_activations": "constant_norm_rescale", "apply_b_dec_to_input": False},
    "jumprelu-transcoder": {"transcoder": True, "d_out": 24, "skip": True},
    "topk-transcoder": {"transcoder": True, "skip": True},
}


def variant(name: str, seed: int = 0) -> SAEWeights:
    return weights(name.split("-")[0], seed, **dict(VARIANTS[name]))


# ------------------------------------------------------------------------------------------- inference
@pytest.mark.parametrize("name", list(VARIANTS))
def test_encode_decode_error_of_every_architecture(name):
    w = variant(name)
    x, target = inputs(), inputs(2, width=w.d_out)
    f = w.encode(x)
    assert f.shape == (12, D_SAE) and w.decode(f, x).shape == (12, w.d_out)
    assert 0 < int((f > 0).sum()) < f.numel() and bool((f >= 0).all())
    # the error term: what the reconstruction misses
    if w.transcoder:
        assert torch.allclose(w.decode(f, x) + w.error(x, target), target, atol=1e-5)
        with pytest.raises(steerkit.InputError, match="target="):
            w.error(x)
    else:
        assert torch.allclose(w.decode(f, x) + w.error(x), x, atol=1e-5)
    # a few latents, as a latent clamp reads them and writes through their decoder rows
    assert torch.allclose(w.encode(x, latents=[5, 0, 63]), f[:, [5, 0, 63]], atol=1e-6)
    part = w.restrict([5, 0, 63])
    assert torch.allclose(part.decode(f[:, [5, 0, 63]], x) - part.b_dec,
                          w.decode(f * torch.isin(torch.arange(D_SAE), torch.tensor([5, 0, 63])), x) - w.b_dec, atol=1e-5)
    # batch dimensions and dtypes
    assert torch.allclose(w.encode(x.reshape(3, 4, D_IN)).reshape(12, D_SAE), f, atol=1e-6)
    assert torch.allclose(w.to(torch.float64).encode(x.double()), f.double(), atol=1e-5)


def test_each_activation_by_its_definition():
    x = inputs()
    relu = weights("relu")
    pre = (x - relu.b_dec) @ relu.W_enc + relu.b_enc
    assert torch.allclose(relu.encode(x), pre.relu(), atol=1e-6)
    jump = weights("jumprelu")
    pre = jump.pre_acts(x)
    assert torch.equal(jump.encode(x), pre.relu() * (pre > jump.threshold))
    gated = weights("gated")
    pre, f = gated.pre_acts(x), gated.encode(x)
    assert bool((f[pre <= 0] == 0).all())
    mag = ((x - gated.b_dec) @ (gated.W_enc * gated.r_mag.exp()) + gated.b_mag).relu()
    assert torch.allclose(f[pre > 0], mag[pre > 0], atol=1e-6)


def test_topk_keeps_the_k_largest():
    w = dataclasses.replace(weights("topk"), b_enc=torch.full((D_SAE,), 10.0))  # every pre-activation positive
    x = inputs()
    f, pre = w.encode(x), w.pre_acts(x)
    assert ((f != 0).sum(-1) == K).all()
    top = pre.topk(K, dim=-1).indices
    assert torch.equal(torch.zeros_like(f, dtype=torch.bool).scatter_(-1, top, True), f != 0)
    assert torch.equal(f.gather(-1, top), pre.gather(-1, top))


def test_normalisation_and_skip_need_the_input_to_decode():
    x = inputs()
    for w in (variant("relu-layer_norm"), variant("topk-transcoder")):
        with pytest.raises(steerkit.InputError, match="decode\\(f, x\\)"):
            w.decode(w.encode(x))
    # layer_norm: the reconstruction of a shifted and scaled input is shifted and scaled back
    w = variant("relu-layer_norm")
    assert torch.allclose(w.reconstruct(3 * x + 1), 3 * w.reconstruct(x) + 1, atol=1e-4)


def test_heads_are_flattened_for_an_attn_z_sae():
    w = dataclasses.replace(weights("relu"), flatten_heads=True)
    z = inputs().reshape(12, 4, 4)
    assert torch.equal(w.encode(z), w.encode(z.flatten(-2)))
    assert torch.allclose(w.reconstruct(z) + w.error(z), z.flatten(-2), atol=1e-5)


@pytest.mark.parametrize("make, match", [
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), architecture="abs"),
     "expected an SAE architecture"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(4, 8), torch.zeros(4)), "expected W_dec of shape"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), architecture="topk"),
     "k as an integer in 1..8"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), architecture="jumprelu"),
     "no threshold"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 6), torch.zeros(6)), "d_out == d_in"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4, dtype=torch.float64)),
     "one dtype"),
    (lambda: SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), normalize_activations="x"),
     "normalize_activations in"),
])
def test_inconsistent_weights_are_refused(make, match):
    with pytest.raises(SAEFormatError, match=match):
        make()
    with pytest.raises(steerkit.InputError, match="expected activations \\[..., 16\\]"):
        weights().encode(torch.zeros(3, 15))


# ------------------------------------------------------------------------------------------- formats
SAELENS_VARIANTS = ["relu", "jumprelu", "topk", "gated", "relu-layer_norm", "topk-constant_norm_rescale",
                    "jumprelu-transcoder"]


@pytest.mark.parametrize("name", SAELENS_VARIANTS)
def test_saelens_round_trip(tmp_path, name):
    w = variant(name)
    out = "blocks.1.hook_mlp_out" if w.transcoder else None
    path = write_saelens(w, tmp_path / "sae", site="blocks.1.hook_resid_mid", output_site=out,
                         metadata={"model_name": "tiny", "context_size": 128})
    folder = read_sae_folder(path)
    assert folder.weights == w and (folder.site, folder.output_site) == ("blocks.1.hook_resid_mid", out)
    assert folder.config["metadata"]["context_size"] == 128
    with pytest.raises(steerkit.errors.PathExistsError):
        write_saelens(w, path, site="blocks.1.hook_resid_mid", output_site=out)


@pytest.mark.parametrize("name", ["topk", "topk-transcoder"])
def test_sparsify_round_trip(tmp_path, name):
    w = variant(name)
    folder = read_sae_folder(write_sparsify(w, tmp_path / "layers.1"))
    assert folder.weights == w and folder.format == "sparsify"
    assert (folder.site, folder.output_site) == sparsify_sites("layers.1", w.transcoder)


def test_formats_fold_b_dec_where_they_must(tmp_path):
    """sparsify's autoencoders always subtract b_dec and sae-lens's transcoders never do: the encoder bias
    absorbs ``b_dec @ W_enc``, the activations stay."""
    x = inputs()
    w = weights("topk", apply_b_dec_to_input=False)
    back = read_sae_folder(write_sparsify(w, tmp_path / "layers.0")).weights
    assert back.apply_b_dec_to_input and rel(back.encode(x), w.encode(x)) < 1e-5
    t = weights("relu", transcoder=True, apply_b_dec_to_input=True)
    back = read_sae_folder(write_saelens(t, tmp_path / "t", site="blocks.0.hook_resid_pre",
                                         output_site="blocks.0.hook_resid_post")).weights
    assert not back.apply_b_dec_to_input and rel(back.encode(x), t.encode(x)) < 1e-5


def test_steerkit_file_and_store_round_trip(tmp_path):
    sae = SAE(variant("jumprelu-transcoder"), "blocks.1.hook_resid_mid", "blocks.1.hook_mlp_out",
              provenance=Provenance(model_name="tiny", method="test"))
    assert steerkit.load_sae(sae.save(tmp_path / "t.safetensors")) == sae
    store = Store(tmp_path / "store")
    assert store.save("tc", sae) == "tc@1" and store.load("tc@1") == sae == steerkit.load_sae("tc@1", store=store)
    row = store.list()[0]
    assert (row["kind"], row["site"], row["d_sae"], row["architecture"]) == ("sae", "blocks.1.hook_resid_mid", 64,
                                                                             "jumprelu")
    assert sae.to(torch.float64).weights.dtype == torch.float64 and sae.clone() == sae


def test_the_source_config_survives_a_save_in_its_format(tmp_path):
    w = variant("topk")
    path = write_saelens(w, tmp_path / "a", site="blocks.0.hook_resid_post",
                         metadata={"model_name": "tiny", "neuronpedia_id": "tiny/0-res"})
    again = steerkit.load_sae(path).save(tmp_path / "b", "saelens")
    meta = json.loads((again / "cfg.json").read_text())["metadata"]
    assert (meta["model_name"], meta["neuronpedia_id"], meta["hook_name"]) == ("tiny", "tiny/0-res",
                                                                             "blocks.0.hook_resid_post")


@pytest.mark.parametrize("name, fmt, match", [
    ("jumprelu", "sparsify", "expected a TopK SAE for sparsify"),
    ("relu-layer_norm", "sparsify", "expected a TopK SAE"),
    ("topk-constant_norm_rescale", "sparsify", "no input normalisation"),
    ("topk-transcoder", "saelens", "expected a ReLU or JumpReLU transcoder"),
])
def test_what_a_format_cannot_hold_is_refused(tmp_path, name, fmt, match):
    w = variant(name)
    sae = SAE(w, "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post" if w.transcoder else None)
    with pytest.raises(SAEFormatError, match=match):
        sae.save(tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_site_mapping():
    assert site_of_hook("blocks.3.hook_mlp_in") == "blocks.3.hook_resid_mid"
    assert site_of_hook("blocks.3.hook_out") == "blocks.3.hook_resid_post"
    assert site_of_hook("blocks.3.attn.hook_z") == "blocks.3.attn.hook_z"
    assert sparsify_sites("h.7", False) == ("blocks.7.hook_resid_post", None)
    assert sparsify_sites("layers.7.self_attn", False) == ("blocks.7.hook_attn_out", None)
    for bad in ("hook_embed", "blocks.3.hook_q_input", "blocks.03.hook_resid_post", 7):
        with pytest.raises(SAEFormatError, match="pass site="):
            site_of_hook(bad)


# ------------------------------------------------------------------------------------------- malformed folders
def _saelens(tmp_path, arch="topk", **cfg_changes):
    path = write_saelens(weights(arch), tmp_path / "sae", site="blocks.1.hook_resid_post")
    cfg = json.loads((path / "cfg.json").read_text())
    for key, value in cfg_changes.items():
        target = cfg["metadata"] if key in ("hook_name", "hook_head_index") else cfg
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path


def _retensor(path, name="sae_weights.safetensors", **changes):
    tensors = load_file(path / name)
    for key, value in changes.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, path / name)
    return path


MALFORMED = {
    "unknown architecture": (lambda p: _saelens(p, architecture="matching_pursuit"), "expected a sae-lens architecture"),
    "training checkpoint": (lambda p: _saelens(p, architecture="batchtopk"), "save_inference_model"),
    "one head": (lambda p: _saelens(p, hook_head_index=3), "single head"),
    "unknown hook": (lambda p: _saelens(p, hook_name="hook_embed"), "pass site="),
    "no hook": (lambda p: _saelens(p, hook_name=None), "name the hook it reads"),
    "bad dtype": (lambda p: _saelens(p, dtype="int8"), "expected dtype in"),
    "k not an integer": (lambda p: _saelens(p, k=2.5), "integer k"),
    "d_sae differs": (lambda p: _saelens(p, d_sae=65), "expected d_sae=65 .* to match the weights"),
    "bad normalisation": (lambda p: _saelens(p, normalize_activations="whiten"), "normalize_activations in"),
    "bool as a number": (lambda p: _saelens(p, d_in=True), "'d_in' .* to be int"),
    "missing tensor": (lambda p: _retensor(_saelens(p), W_dec=None), "missing W_dec"),
    "extra tensor": (lambda p: _retensor(_saelens(p), extra=torch.zeros(3)), "unexpected extra"),
    "transposed decoder": (lambda p: _retensor(_saelens(p), W_dec=torch.zeros(D_IN, D_SAE)), "expected W_dec of shape"),
    "NaN": (lambda p: _retensor(_saelens(p), b_dec=torch.full((D_IN,), float("nan"))), "finite values .* b_dec"),
    "integer tensor": (lambda p: _retensor(_saelens(p), b_dec=torch.zeros(D_IN, dtype=torch.int64)), "floating-point"),
    "scaling factor": (lambda p: _retensor(_saelens(p), scaling_factor=torch.full((D_SAE,), 2.0)), "scaling_factor"),
    "config not JSON": (lambda p: (_saelens(p) / "cfg.json").write_text("{not json") and p / "sae", "valid JSON"),
    "config a list": (lambda p: (_saelens(p) / "cfg.json").write_text("[1]") and p / "sae", "a JSON object"),
    "config NaN": (lambda p: (_saelens(p) / "cfg.json").write_text('{"k": NaN}') and p / "sae", "finite JSON numbers"),
    "no config": (lambda p: (_saelens(p) / "cfg.json").unlink() or p / "sae", "expected an SAE config"),
    "garbage weights": (lambda p: (_saelens(p) / "sae_weights.safetensors").write_bytes(b"\x10" * 64) and p / "sae",
                        "readable safetensors"),
    "empty folder": (lambda p: (p / "empty").mkdir() or p / "empty", "found an empty folder"),
    "nothing there": (lambda p: p / "missing", "found nothing"),
    "groupmax": (lambda p: _sparsify(p, activation="groupmax"), "expected a TopK sparse coder"),
    "sparsify shape": (lambda p: _sparsify(p, num_latents=32), "encoder.weight of shape"),
    "sparsify name": (lambda p: _sparsify(p, name="encoder_out"), "named after its hookpoint"),
    "sparsify attention transcoder": (lambda p: _sparsify(p, name="layers.2.self_attn", transcode=True),
                                      "expected site= for a transcoder"),
}


def _sparsify(tmp_path, name="layers.2", **cfg_changes):
    transcoder = cfg_changes.get("transcode", False)
    path = write_sparsify(weights("topk", transcoder=transcoder), tmp_path / name)
    cfg = json.loads((path / "cfg.json").read_text())
    cfg.update(cfg_changes)
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_folder_is_refused(tmp_path, case):
    make, match = MALFORMED[case]
    path = make(tmp_path)
    with pytest.raises(SAEFormatError, match=match) as e:
        steerkit.load_sae(path) if path.exists() else read_sae_folder(path)
    assert str(e.value).startswith("expected")


def test_a_folder_without_a_site_reads_with_one(tmp_path):
    path = _sparsify(tmp_path, name="layers.2.mlp", transcode=True)
    sae = steerkit.load_sae(path, site="blocks.2.ln2.hook_normalized", output_site="blocks.2.hook_mlp_out")
    assert (sae.site, sae.output_site, detect_format(path)) == ("blocks.2.ln2.hook_normalized",
                                                                "blocks.2.hook_mlp_out", "sparsify")
    vector = save_artifact(SteeringVector.from_direction(torch.ones(4), layer=0), tmp_path / "v.safetensors")
    with pytest.raises(VectorsError, match="expected an SAE at .* found a steering_vector"):
        steerkit.load_sae(vector)


def test_a_damaged_steerkit_payload_is_refused(tmp_path):
    sae = SAE(weights("topk"), "blocks.0.hook_resid_post")
    tensors, meta = sae.to_payload()
    meta["fields"]["weights"]["k"] = "eight"
    with pytest.raises(ArtifactFormatError, match="k as int"):
        payload_to_artifact(tensors, meta)
    tensors, meta = sae.to_payload()
    tensors["W_enc"] = tensors["W_enc"][:, :10]
    with pytest.raises(ArtifactFormatError, match="valid SAE payload"):
        payload_to_artifact(tensors, meta)


# ------------------------------------------------------------------------------------------- against a model
@pytest.fixture(scope="module")
def tiny_pair():
    """Two tiny Llamas of the same shape and different weights (d_model 64, 2 blocks, MLP 128)."""
    return [steerkit.wrap(*tiny_model("llama", seed), name=f"tiny-{seed}") for seed in (0, 1)]


def test_the_model_check(tmp_path, tiny_pair):
    a, b = tiny_pair
    g = torch.Generator().manual_seed(0)
    w = SAEWeights(torch.randn(64, 96, generator=g), torch.zeros(96), torch.randn(96, 64, generator=g), torch.zeros(64))
    folder = write_saelens(w, tmp_path / "sae", site="blocks.1.hook_resid_post")
    sae = steerkit.load_sae(folder, model=a)  # a folder records the model it is checked against
    assert (sae.provenance.model_fingerprint, sae.provenance.n_layers) == (a.fingerprint(), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sae.check(a) == []
    file = sae.save(tmp_path / "sae.safetensors")
    with pytest.raises(ModelMismatchError, match="fingerprint differs"):
        steerkit.load_sae(file, model=b)
    with pytest.warns(UserWarning, match="override: fingerprint differs"):
        steerkit.load_sae(file, model=b, override=True)
    # widths and sites are never overridden
    mlp = SAEWeights(torch.randn(96, 32), torch.zeros(32), torch.randn(32, 96), torch.zeros(96))
    with pytest.raises(ModelMismatchError, match="to read 128 features"):
        SAE(mlp, "blocks.0.mlp.hook_post").check(a, override=True)
    with pytest.raises(ModelMismatchError, match="to exist on"):
        SAE(w, "blocks.5.hook_resid_post").check(a.facts)
    with pytest.raises(ModelMismatchError, match="d_model=64"):
        steerkit.load_sae(write_saelens(mlp, tmp_path / "wide", site="blocks.0.hook_resid_post"), model=a)


# ------------------------------------------------------------------------------------------- sparsify itself
os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")  # its Triton decoder needs CUDA tensors


@pytest.fixture(scope="module")
def sparsify():
    return pytest.importorskip("sparsify", reason="the 'sae' extra (eai-sparsify) is not installed")


def _sparse_coder(sparsify, seed: int, **cfg):
    torch.manual_seed(seed)
    sc = sparsify.SparseCoder(D_IN, sparsify.SparseCoderConfig(num_latents=D_SAE, k=K, **cfg), dtype=torch.float32)
    with torch.no_grad():  # sparsify initialises biases (and a transcoder's decoder) at zero
        for p in (sc.encoder.bias, sc.b_dec, sc.W_dec, *([sc.W_skip] if sc.W_skip is not None else [])):
            p.normal_(0, 0.3)
    return sc


def _untied(pre: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th largest pre-activations differ: there TopK's choice is unambiguous."""
    top = pre.topk(K + 1, dim=-1).values
    return (top[:, K - 1] - top[:, K]) > tol


@pytest.mark.parametrize("kind", ["sae", "transcoder"])
def test_sparsify_coder_and_steerkit_agree(tmp_path, sparsify, kind):
    transcoder = kind == "transcoder"
    sc = _sparse_coder(sparsify, 3, transcode=transcoder, skip_connection=transcoder)
    sc.save_to_disk(tmp_path / "layers.1")
    sae = steerkit.load_sae(tmp_path / "layers.1")
    assert (sae.architecture, sae.weights.transcoder, sae.site) == (
        "topk", transcoder, "blocks.1.hook_resid_pre" if transcoder else "blocks.1.hook_resid_post")
    x = inputs(seed=4, rows=64)
    with torch.no_grad():
        out = sc.encode(x)
        theirs = torch.zeros(64, D_SAE).scatter_(-1, out.top_indices, out.top_acts)
        ours = sae.encode(x)
        rows = _untied(sae.weights.pre_acts(x))
        assert int(rows.sum()) >= 60
        assert rel(ours[rows], theirs[rows]) < 1e-5
        # decode: sparsify's decode of its own top-k (a transcoder's forward adds its skip connection)
        if not transcoder:
            assert rel(sae.decode(theirs), sc.decode(out.top_acts, out.top_indices)) < 1e-5
        assert rel(sae.decode(theirs, x), sc(x).sae_out) < 1e-5
        # and back: steerkit's sparsify folder, read by sparsify
        back = sparsify.SparseCoder.load_from_disk(sae.save(tmp_path / "again" / "layers.1", "sparsify"))
        again = back.encode(x)
        dense = torch.zeros(64, D_SAE).scatter_(-1, again.top_indices, again.top_acts)
        assert rel(dense[rows], ours[rows]) < 1e-5 and rel(back(x).sae_out, sae.decode(ours, x)) < 1e-5


def test_a_steerkit_sae_loads_in_sparsify(tmp_path, sparsify):
    """A TopK SAE that does not subtract b_dec (as sae-lens may store one) written for sparsify, which does."""
    w = weights("topk", apply_b_dec_to_input=False)
    sc = sparsify.SparseCoder.load_from_disk(SAE(w, "blocks.0.hook_resid_post").save(tmp_path / "layers.0", "sparsify"))
    x = inputs(seed=5, rows=64)
    with torch.no_grad():
        out = sc.encode(x)
        dense = torch.zeros(64, D_SAE).scatter_(-1, out.top_indices, out.top_acts)
        rows = _untied(w.pre_acts(x))
        assert rel(dense[rows], w.encode(x)[rows]) < 1e-5
        assert rel(sc.decode(out.top_acts, out.top_indices), w.decode(dense)) < 1e-5
