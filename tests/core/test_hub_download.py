"""Models from the Hugging Face Hub: the real huggingface_hub and transformers download code, and
``steerkit.load_model("org/name")`` on top of it, pointed at ``tests.hub_server.LocalHub`` (a local server in the
Hub's URL layout), fully offline."""
from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers
import transformers.utils.hub
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

from hub_server import COMMIT, LocalHub, use_hub

REPO = "org/tiny-llama"


@pytest.fixture(scope="module")
def tiny_repo(scratch) -> tuple[Path, dict[str, torch.Tensor]]:
    """A folder with a random-weight 2-layer Llama and the default model's tokenizer, and the model's state dict."""
    from steerkit.loading.resolve import resolve

    _, default_folder, _ = resolve(None)  # the converted default model's folder (cached; no conversion here)
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_folder)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = scratch("repo")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def load(cache: str, repo_id: str = REPO, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(repo_id, cache_dir=cache, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(repo_id, cache_dir=cache, **kwargs)
    return model, tokenizer


def test_hf_hub_download_gets_the_file(tiny_repo, tmp_path, monkeypatch):
    folder, _ = tiny_repo
    with LocalHub({REPO: folder}) as hub:
        cache = use_hub(monkeypatch, tmp_path, hub)
        path = huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=cache, endpoint=hub.url)
        assert Path(path).read_bytes() == (folder / "config.json").read_bytes()
        assert Path(path).parent.name == COMMIT
        # the pinned commit resolves too, and is then served from the cache without a request
        n = len(hub.requests)
        assert huggingface_hub.hf_hub_download(REPO, "config.json", revision=COMMIT, cache_dir=cache) == path
        assert len(hub.requests) == n
        assert ("HEAD", f"/{REPO}/resolve/main/config.json") in hub.requests
        with pytest.raises(huggingface_hub.errors.RemoteEntryNotFoundError):
            huggingface_hub.hf_hub_download(REPO, "absent.json", cache_dir=cache)
        with pytest.raises(huggingface_hub.errors.RevisionNotFoundError):
            huggingface_hub.hf_hub_download(REPO, "config.json", revision="v9", cache_dir=cache)
        info = huggingface_hub.model_info(REPO)
        assert info.sha == COMMIT and "model.safetensors" in {s.rfilename for s in info.siblings}


def test_transformers_downloads_then_loads_offline(tiny_repo, tmp_path, monkeypatch):
    folder, state = tiny_repo
    with LocalHub({REPO: folder}) as hub:
        cache = use_hub(monkeypatch, tmp_path, hub)
        model, tokenizer = load(cache)
        loaded = model.state_dict()
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        assert tokenizer("hello world").input_ids == transformers.AutoTokenizer.from_pretrained(folder)(
            "hello world").input_ids
        assert ("GET", f"/{REPO}/resolve/{COMMIT}/model.safetensors") in hub.requests
        # optional files were probed, answered 404 EntryNotFound, and taken as absent
        assert ("HEAD", f"/{REPO}/resolve/{COMMIT}/tokenizer.model") in hub.requests

        n = len(hub.requests)
        model, _ = load(cache, local_files_only=True)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert len(hub.requests) == n, hub.requests[n:]

        # offline mode: HF_HUB_OFFLINE is read once at import, so the env alone does nothing now ...
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert not huggingface_hub.is_offline_mode()
        # ... and the constant it set at import is what both libraries check
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        model, _ = load(cache)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert len(hub.requests) == n, hub.requests[n:]


def test_unknown_repo_raises(tiny_repo, tmp_path, monkeypatch):
    folder, _ = tiny_repo
    with LocalHub({REPO: folder}) as hub:
        cache = use_hub(monkeypatch, tmp_path, hub)
        with pytest.raises(RepositoryNotFoundError, match="Repository Not Found"):
            huggingface_hub.hf_hub_download("org/missing", "config.json", cache_dir=cache)
        with pytest.raises(OSError, match="org/missing is not a local folder and is not a valid model identifier"):
            transformers.AutoModelForCausalLM.from_pretrained("org/missing", cache_dir=cache)


def test_token_is_passed_through(tiny_repo, tmp_path, monkeypatch):
    folder, state = tiny_repo
    with LocalHub({REPO: folder}, token="secret") as hub:
        cache = use_hub(monkeypatch, tmp_path, hub)
        with pytest.raises(RepositoryNotFoundError):
            huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=cache)
        with pytest.raises(OSError, match="is not a valid model identifier"):
            transformers.AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache)
        with pytest.raises(RepositoryNotFoundError):
            huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=cache, token="wrong")
        assert not (Path(cache) / "models--org--tiny-llama" / "snapshots").exists()

        model, tokenizer = load(cache, token="secret")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert len(tokenizer) == model.config.vocab_size


# ----------------------------------------------------------------------------- steerkit.load_model
def _same_weights(sm, state: dict) -> bool:
    loaded = sm.hf_model.state_dict()
    return loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_load_model_downloads_a_hub_id_then_reads_the_cache(tiny_repo, tmp_path, monkeypatch):
    import steerkit

    folder, state = tiny_repo
    with LocalHub({REPO: folder}) as hub:
        cache = Path(use_hub(monkeypatch, tmp_path, hub))
        sm = steerkit.load_model(REPO)
        assert sm.name == REPO and sm.n_layers == 2 and sm.dtype == torch.float32 and _same_weights(sm, state)
        assert ("GET", f"/{REPO}/resolve/{COMMIT}/model.safetensors") in hub.requests
        assert (cache / "models--org--tiny-llama" / "snapshots" / COMMIT / "config.json").is_file()
        assert sm.generate("hello", max_new_tokens=3, return_tokens=True)  # a working model, not just weights

        n = len(hub.requests)  # the cache alone: local_files_only, then huggingface_hub's offline mode
        assert _same_weights(steerkit.load_model(REPO, local_files_only=True), state)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        again = steerkit.load_model(REPO, revision=COMMIT, dtype="bfloat16")
        assert again.dtype == torch.bfloat16 and len(hub.requests) == n, hub.requests[n:]


def test_offline_without_the_files_names_both_ways_out(tiny_repo, tmp_path, monkeypatch):
    import steerkit
    from steerkit.errors import ModelNotFoundError

    folder, _ = tiny_repo
    with LocalHub({REPO: folder}) as hub:
        use_hub(monkeypatch, tmp_path, hub)
        with pytest.raises(ModelNotFoundError, match=r"local_files_only=True was passed: go online .* pass its path"):
            steerkit.load_model(REPO, local_files_only=True)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(ModelNotFoundError, match=r"in the local Hugging Face cache .*HF_HUB_OFFLINE=1 is set: "
                                                     r"go online \(unset HF_HUB_OFFLINE"):
            steerkit.load_model(REPO)
        assert hub.requests == []


def test_unknown_private_and_gated_repos_say_what_to_do(tiny_repo, tmp_path, monkeypatch):
    import steerkit
    from steerkit.errors import ModelNotFoundError

    folder, state = tiny_repo
    with LocalHub({REPO: folder}, token="secret") as hub:
        use_hub(monkeypatch, tmp_path, hub)
        with pytest.raises(ModelNotFoundError, match=r"expected a model repository 'org/missing' on the Hub "
                                                     r"\(http://127\.0\.0\.1:\d+\).*pass token= \(or run `hf auth login`\)"):
            steerkit.load_model("org/missing", token="secret")
        with pytest.raises(ModelNotFoundError, match=r"'org/tiny-llama' at revision 'v9'"):
            steerkit.load_model(REPO, revision="v9", token="secret")
        with pytest.raises(ModelNotFoundError, match="private or gated"):
            steerkit.load_model(REPO)  # no token: the Hub answers as for a repository that does not exist
        assert _same_weights(steerkit.load_model(REPO, token="secret"), state)
