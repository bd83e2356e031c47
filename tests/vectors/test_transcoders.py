"""Transcoders (steerkit.vectors.Transcoders, steerkit.load_transcoders): the formats people have -- circuit-tracer's
cache folder, its Hub layout (local paths, hf:// URIs, a Hub reference), its cross-layer files, GemmaScope's .npz and
GemmaScope 2's safetensors as its configs list them, sparsify's TopK transcoder folders with and without a skip
connection, sae-lens's transcoder folders -- read into one artifact and checked against the model; the math of
encode / decode; the store (no pickle); circuit-tracer's layout written back; the one bounded JSON / YAML reader
(a deep config.yaml or cfg.json is a steerkit error, not Python's RecursionError; no aliases, no Python tags)."""
from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

import steerkit
from steerkit.sae import SAEFormatError, SAEWeights, read_sae_folder, write_saelens, write_sparsify
from steerkit.vectors import ArtifactFormatError, ModelMismatchError, Provenance, Store, Transcoders, VectorsError
from steerkit.vectors.transcoder_files import read_circuit_tracer
from hub_server import LocalHub, use_hub
from tiny_models import random_transcoders, tiny_circuit_llama

D = 64


@pytest.fixture(scope="module")
def sm():
    model, tok = tiny_circuit_llama()
    return steerkit.wrap(model, tok, name="tiny-circuit-llama")


def _layer_tensors(tc: Transcoders, l: int) -> dict[str, torch.Tensor]:
    out = {"W_enc": tc.W_enc[l], "W_dec": tc.W_dec[l], "b_enc": tc.b_enc[l], "b_dec": tc.b_dec[l]}
    if tc.threshold is not None:
        out["activation_function.threshold"] = tc.threshold[l]
    if tc.W_skip is not None:
        out["W_skip"] = tc.W_skip[l]
    return out


@pytest.mark.parametrize("options", [dict(activation="relu"), dict(activation="jumprelu", skip=True),
                                     dict(activation="jumprelu", cross_layer=True, input_hook="hook_resid_mid")],
                         ids=["relu", "jumprelu-skip", "cross-layer"])
def test_circuit_tracer_cache_folder_round_trip(sm, tmp_path, options):
    tc = random_transcoders(sm, **options)
    folder = tc.save(tmp_path / "tc", "circuit-tracer")
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    assert cfg == {"model_kind": "cross_layer_transcoder" if tc.cross_layer else "transcoder_set",
                   "feature_input_hook": tc.input_hook, "feature_output_hook": "hook_mlp_out", "scan": tc.scan}
    names = sorted(p.name for p in folder.iterdir())
    if tc.cross_layer:
        assert set(load_file(folder / "W_enc_1.safetensors")) == {"W_enc_1", "b_enc_1", "b_dec_1", "threshold_1"}
        assert load_file(folder / "W_dec_1.safetensors")["W_dec_1"].shape == (tc.d_sae, sm.n_layers - 1, D)
    else:
        assert names == ["config.yaml"] + [f"layer_{l}.safetensors" for l in range(sm.n_layers)]
        assert set(load_file(folder / "layer_0.safetensors")) == set(_layer_tensors(tc, 0))
    (folder / "README.md").write_text("other files are ignored")
    (folder / "notes.bin").write_bytes(b"\x00" * 10)
    back = steerkit.load_transcoders(folder, model=sm)
    assert back.tensors().keys() == tc.tensors().keys()
    assert all(torch.equal(back.tensors()[k], t) for k, t in tc.tensors().items())
    assert (back.activation, back.cross_layer, back.input_hook, back.scan) == \
        (tc.activation, tc.cross_layer, tc.input_hook, tc.scan)
    assert back.provenance.model_fingerprint == sm.fingerprint()  # the files name no model: the check records it
    with pytest.raises(VectorsError, match="overwrite=True"):
        tc.save(folder, "circuit-tracer")


def test_encode_decode_math(sm):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sm.n_layers, 5, D, generator=g) * 4
    tc = random_transcoders(sm, activation="jumprelu", skip=True)
    f = tc.encode(x)
    for l in range(sm.n_layers):
        pre = x[l] @ tc.W_enc[l].T + tc.b_enc[l]
        assert torch.allclose(f[l], pre * (pre > tc.threshold[l]), atol=1e-6)
    y = tc.decode(f, x)
    for l in range(sm.n_layers):
        assert torch.allclose(y[l], f[l] @ tc.W_dec[l] + tc.b_dec[l] + x[l] @ tc.W_skip[l].T, atol=1e-5)
    clt = random_transcoders(sm, activation="relu", cross_layer=True)
    f = clt.encode(x)
    assert torch.allclose(f, F.relu(torch.einsum("lpd,lfd->lpf", x, torch.stack(clt.W_enc)) + torch.stack(clt.b_enc)[:, None]),
                          atol=1e-5)
    y = clt.decode(f)
    for l in range(sm.n_layers):
        want = clt.b_dec[l] + sum(f[s] @ clt.W_dec[s][:, l - s] for s in range(l + 1))
        assert torch.allclose(y[l], want, atol=1e-5)
    topk = random_transcoders(sm, activation="topk", k=5)
    assert ((topk.encode(x) != 0).sum(-1) <= 5).all() and ((topk.encode(x) != 0).sum(-1) == 5).any()


def test_hub_layout_local_paths_and_hf_uris(sm, tmp_path, monkeypatch):
    """A config listing per-layer files: paths relative to the config's folder, hf:// URIs through the Hub's cache,
    GemmaScope's .npz (W_enc [d_model, d_sae]) and GemmaScope 2's lowercase safetensors, as circuit-tracer reads them."""
    tc = random_transcoders(sm, activation="jumprelu")
    repo = tmp_path / "repo"
    (repo / "files").mkdir(parents=True)
    save_file(_layer_tensors(tc, 0), str(repo / "files" / "layer_0.safetensors"))
    w1 = _layer_tensors(tc, 1)
    np.savez(repo / "files" / "layer_1.npz", W_enc=w1["W_enc"].T.numpy(), W_dec=w1["W_dec"].numpy(),
             b_enc=w1["b_enc"].numpy(), b_dec=w1["b_dec"].numpy(), threshold=w1["activation_function.threshold"].numpy())
    w2 = _layer_tensors(tc, 2)
    save_file({"w_enc": w2["W_enc"].T.contiguous(), "w_dec": w2["W_dec"], "b_enc": w2["b_enc"], "b_dec": w2["b_dec"],
               "threshold": w2["activation_function.threshold"]}, str(repo / "files" / "layer_2.safetensors"))
    local = tmp_path / "local"
    local.mkdir()
    cfg = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
           "scan": "tiny-hub", "transcoders": ["../repo/files/layer_0.safetensors", "../repo/files/layer_1.npz",
                                               "../repo/files/layer_2.safetensors"]}
    (local / "config.yaml").write_text(yaml.safe_dump(cfg))
    back = steerkit.load_transcoders(local, model=sm)
    assert back.output_hook == "hook_mlp_out" and back.scan == "tiny-hub"
    assert all(torch.allclose(back.tensors()[k], t) for k, t in tc.tensors().items())
    with LocalHub({"org/tcs": repo}) as hub:
        use_hub(monkeypatch, tmp_path, hub)
        cfg["transcoders"] = [f"hf://org/tcs/files/layer_{l}.{'npz' if l == 1 else 'safetensors'}" for l in range(3)]
        (local / "config.yaml").write_text(yaml.safe_dump(cfg))
        assert all(torch.allclose(steerkit.load_transcoders(local).tensors()[k], t) for k, t in tc.tensors().items())
        tc.save(repo / "cache-layout", "circuit-tracer")
        ref = steerkit.load_transcoders("org/tcs/cache-layout", model=sm)
        assert all(torch.equal(ref.tensors()[k], t) for k, t in tc.tensors().items())
        assert ref.scan == "org/tcs//cache-layout"  # circuit-tracer's scan for Hub transcoders (Neuronpedia's)
        assert steerkit.load_transcoders("org/tcs/cache-layout@main").scan == "org/tcs//cache-layout@main"
        with pytest.raises(VectorsError, match="Hub"):
            steerkit.load_transcoders("org/absent")


def test_cross_layer_files_without_config(sm, tmp_path):
    tc = random_transcoders(sm, activation="relu", cross_layer=True)
    folder = tc.save(tmp_path / "clt", "circuit-tracer")
    (folder / "config.yaml").unlink()
    back = steerkit.load_transcoders(folder)
    assert back.cross_layer and back.input_hook == "hook_resid_mid"  # what circuit-tracer assumes then
    assert all(torch.equal(back.tensors()[k], t) for k, t in tc.tensors().items())


def _sae_layer(arch: str, skip: bool, seed: int) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    n = 48
    return SAEWeights(torch.randn(D, n, generator=g) / 8, torch.randn(n, generator=g) * 0.1, torch.randn(n, D, generator=g) / 8,
                      torch.randn(D, generator=g) * 0.1, architecture=arch, k=6 if arch == "topk" else None,
                      threshold=torch.rand(n, generator=g) * 0.2 if arch == "jumprelu" else None,
                      W_skip=torch.randn(D, D, generator=g) / 16 if skip else None, transcoder=True,
                      apply_b_dec_to_input=False)


@pytest.mark.parametrize("fmt,arch,skip", [("sparsify", "topk", False), ("sparsify", "topk", True),
                                           ("saelens", "relu", False), ("saelens", "jumprelu", True)])
def test_sparsify_and_saelens_transcoder_folders(sm, tmp_path, fmt, arch, skip):
    layers = [_sae_layer(arch, skip, l) for l in range(sm.n_layers)]
    for l, w in enumerate(layers):
        if fmt == "sparsify":
            write_sparsify(w, tmp_path / "set" / f"layers.{l}.mlp")
        else:
            write_saelens(w, tmp_path / "set" / f"layer-{l}", site=f"blocks.{l}.mlp.hook_in",
                          output_site=f"blocks.{l}.hook_mlp_out")
    tc = steerkit.load_transcoders(tmp_path / "set", model=sm)
    assert (tc.activation, tc.skip_connection, tc.sites(1)) == (arch, skip, ("blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out"))
    x = torch.randn(sm.n_layers, 7, D) * 2
    f = tc.encode(x)
    for l, w in enumerate(read_sae_folder(p).weights for p in sorted((tmp_path / "set").iterdir())):
        assert torch.allclose(f[l], w.encode(x[l]), atol=1e-5)  # sparsify's and sae-lens's own math (tests/test_sae.py)
        assert torch.allclose(tc.decode(f, x)[l], w.decode(w.encode(x[l]), x[l]), atol=1e-5)


def test_store_round_trip_without_pickle(sm, tmp_path):
    store = Store(tmp_path / "store")
    for tc in (random_transcoders(sm, activation="topk"), random_transcoders(sm, cross_layer=True)):
        ref = store.save("tc", tc)
        assert store.load(ref) == tc
        obj = tmp_path / "store" / "objects" / "tc" / ref.split("@")[1]
        assert sorted(p.suffix for p in obj.iterdir()) == [".json", ".safetensors"]
        assert steerkit.load_transcoders(ref, store=store) == tc


def test_checked_against_the_model(sm):
    tc = random_transcoders(sm)
    assert tc.check(sm) == []
    two = Transcoders(tc.W_enc[:2], tc.b_enc[:2], tc.W_dec[:2], tc.b_dec[:2], activation="jumprelu",
                      threshold=tc.threshold[:2])
    with pytest.raises(ModelMismatchError, match="each of the model's 3 blocks"):
        two.check(sm)
    wide = Transcoders([torch.zeros(8, 32)] * 3, [torch.zeros(8)] * 3, [torch.zeros(8, 32)] * 3, [torch.zeros(32)] * 3)
    with pytest.raises(ModelMismatchError, match="d_model=64"):
        wide.check(sm)
    other = Transcoders(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, activation="jumprelu", threshold=tc.threshold,
                        provenance=Provenance(model_name="another", model_fingerprint="sk1:other"))
    with pytest.raises(ModelMismatchError, match="fingerprint differs"):
        other.check(sm)
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        assert other.check(sm, override=True)
    assert any("fingerprint" in str(w.message) for w in issued)


def test_malformed_transcoders_are_refused(sm, tmp_path):
    tc = random_transcoders(sm, activation="relu")
    folder = tc.save(tmp_path / "tc", "circuit-tracer")
    (folder / "layer_1.safetensors").rename(folder / "layer_7.safetensors")
    with pytest.raises(ArtifactFormatError, match="numbered 0..2"):
        read_circuit_tracer(folder)
    folder = tc.save(tmp_path / "tc2", "circuit-tracer")
    save_file({"W_enc": tc.W_enc[0], "W_dec": tc.W_dec[0], "b_enc": tc.b_enc[0]}, str(folder / "layer_0.safetensors"))
    with pytest.raises(ArtifactFormatError, match="b_dec"):
        read_circuit_tracer(folder)
    save_file({**_layer_tensors(tc, 0), "log_thresholds": tc.b_enc[0].clone()}, str(folder / "layer_0.safetensors"))
    with pytest.raises(ArtifactFormatError, match="log_thresholds"):
        read_circuit_tracer(folder)
    save_file({**_layer_tensors(tc, 0), "W_dec": torch.zeros(5, D)}, str(folder / "layer_0.safetensors"))
    with pytest.raises(ArtifactFormatError, match="belong together"):
        read_circuit_tracer(folder)
    (folder / "layer_0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ArtifactFormatError, match="header length"):
        read_circuit_tracer(folder)
    (folder / "config.yaml").write_text("model_kind: mystery\n")
    with pytest.raises(ArtifactFormatError, match="model_kind"):
        read_circuit_tracer(folder)
    with zipfile.ZipFile(tmp_path / "bad.npz", "w") as z:
        z.writestr("W_enc.txt", "not an array")
    (folder / "config.yaml").write_text(yaml.safe_dump({"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
                                                        "feature_output_hook": "hook_mlp_out", "transcoders": ["../bad.npz"]}))
    with pytest.raises(ArtifactFormatError, match=r"only \.npy"):
        read_circuit_tracer(folder)
    with pytest.raises(VectorsError, match="ReLU or JumpReLU"):
        random_transcoders(sm, activation="topk").save(tmp_path / "topk", "circuit-tracer")
    with pytest.raises(VectorsError, match="threshold exactly"):
        Transcoders(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, activation="jumprelu")


@pytest.mark.parametrize("text,match", [
    ("model_kind: transcoder_set\nx: " + "[" * 200 + "]" * 200 + "\n", "nested at most 64 deep"),
    ("model_kind: transcoder_set\na: &x [1]\nb: *x\n", "without aliases"),
    ("!!python/object/apply:os.system ['echo unsafe']\n", "plain YAML data"),
    ("model_kind: [unclosed\n", "valid"),
], ids=["deep", "alias", "python-tag", "syntax"])
def test_config_yaml_is_read_bounded_and_safe(tmp_path, text, match):
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ArtifactFormatError, match=match):
        read_circuit_tracer(tmp_path)


def test_config_yaml_size_is_bounded(tmp_path):
    (tmp_path / "config.yaml").write_text("model_kind: transcoder_set\npad: '" + "x" * (2 << 20) + "'\n")
    with pytest.raises(ArtifactFormatError, match="at most 1048576 bytes"):
        read_circuit_tracer(tmp_path)


def test_deeply_nested_sae_cfg_json_is_a_steerkit_error(tmp_path):
    """Before the one bounded reader, json.loads raised Python's own RecursionError here."""
    w = SAEWeights(torch.randn(D, 16), torch.zeros(16), torch.randn(16, D), torch.zeros(D))
    folder = write_saelens(w, tmp_path / "sae", site="blocks.0.hook_resid_post")
    cfg = json.loads((folder / "cfg.json").read_text())
    (folder / "cfg.json").write_text(json.dumps(cfg)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(SAEFormatError, match="nested at most 64 deep"):
        read_sae_folder(folder)
    (folder / "cfg.json").write_text(json.dumps(cfg)[:-1] + ', "deep": ' + "[" * 80 + "]" * 80 + "}")
    with pytest.raises(SAEFormatError, match="nested at most 64 deep"):
        read_sae_folder(folder)


def test_weights_are_memory_mapped_not_copied(sm, tmp_path):
    tc = random_transcoders(sm)
    back = steerkit.load_transcoders(tc.save(tmp_path / "tc", "circuit-tracer"))
    assert back.W_dec[0].untyped_storage().nbytes() > back.W_dec[0].numel() * 4  # a view of the whole file's map
    back.W_dec[0][0, 0] = 123.0  # the map is private: the file is not changed
    assert load_file(tmp_path / "tc" / "layer_0.safetensors")["W_dec"][0, 0] == tc.W_dec[0][0, 0]
    assert Path(tmp_path / "tc" / "config.yaml").exists()
