"""An SAE's latents as hook sites (``sm.attach_sae``, :mod:`steerkit.saesites`): the sub-sites exist only while
an SAE is attached, their values are the SAE's own math on the site's activation (bit for bit on the rows of one
pass, on tiny models of every architecture and on the default model), KV-cached generation records the rows a full
forward pass gives, handles come off after exceptions, the splice is an edit that composes, and the sharded dataset
keeps the latents sparse (format 2) while format 1 still reads."""
from __future__ import annotations

import json

import pytest
import torch

import steerkit
from steerkit.errors import HookNameError, InputError
from steerkit.hooks.names import SAE_HOOKS, parse
from steerkit.saesites import SAEHandle, splice_intervention
from steerkit.sae import SAEWeights
from steerkit.recording import record_dataset
from steerkit.storage.dataset import FORMAT, FORMAT_SPARSE, ActivationDataset
from steerkit.vectors import SAE, Provenance

from sae_weights import rel  # noqa: E402

SITE = "blocks.1.hook_resid_post"
PROMPTS = ["hello world", "hi", "good morning to you"]


@pytest.fixture
def clean(tiny):
    yield tiny
    leftover = (tiny.hook_count(), len(tiny.hooks.handles), dict(tiny.hooks.saes))
    tiny.reset()
    assert leftover == (0, 0, {}), f"test left hooks, handles or SAEs behind: {leftover}"


def weights(arch: str, d: int = 64, d_sae: int = 256, seed: int = 0, **options) -> SAEWeights:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d_sae, generator=g) / d ** 0.5
    extra: dict = {"relu": {}, "topk": {"k": 12}, "jumprelu": {"threshold": torch.rand(d_sae, generator=g) * 0.3},
                   "gated": {"b_mag": torch.randn(d_sae, generator=g) * 0.1, "r_mag": torch.randn(d_sae, generator=g) * 0.1}}
    return SAEWeights(W, torch.randn(d_sae, generator=g) * 0.1, W.T.clone() / 2, torch.randn(d, generator=g) * 0.1,
                      architecture=arch, **extra[arch], **options)


def rows(cache, name: str) -> torch.Tensor:
    """The rows one record kept, row after row (what the SAE's hook ran on, in that order)."""
    v, n = cache[name], cache.lengths(name)
    return torch.cat([v[r, : int(n[r])] for r in range(v.shape[0])])


def test_sub_sites_exist_only_while_an_sae_is_attached(clean):
    tiny, w = clean, weights("relu")
    acts = f"{SITE}.hook_sae_acts_post"
    with pytest.raises(HookNameError, match=r"expected an SAE attached at 'blocks.1.hook_resid_post'.*attach_sae"):
        tiny.record(acts)
    with tiny.attach_sae(w, SITE) as h:
        assert isinstance(h, SAEHandle) and h.names == [f"{SITE}.{k}" for k in SAE_HOOKS]
        assert tiny.hooks.parse(acts).parent == SITE and tiny.hooks.parse(acts).layer == 1
        with pytest.raises(HookNameError, match="expected an SAE attached at 'blocks.0.hook_resid_post'"):
            tiny.record("blocks.0.hook_resid_post.hook_sae_acts_post")
        with pytest.raises(HookNameError, match="hook_sae_input"):
            tiny.record(f"{SITE}.hook_sae_latents")
        with pytest.raises(InputError, match="one SAE at"):
            tiny.attach_sae(w, SITE)
        with pytest.raises((InputError, HookNameError), match="only be recorded|expected an SAE attached"):
            with tiny.steer(steerkit.Intervention.add(acts, torch.ones(256))):
                pass
        with pytest.raises(InputError, match="can only be recorded"):
            tiny.hooks.install([(acts, None)])
    with pytest.raises(HookNameError, match="attach_sae"):
        tiny.record(acts)
    with pytest.raises(HookNameError, match="no SAE can be attached"):
        parse("blocks.1.attn.hook_pattern.hook_sae_acts_post", 4, sae_sites={"blocks.1.attn.hook_pattern"})
    with pytest.raises(InputError, match="rows of features"):
        tiny.attach_sae(w, "blocks.1.ln1.hook_scale")


def test_what_attach_refuses(clean):
    tiny = clean
    with pytest.raises(InputError, match="read 64 features"):
        tiny.attach_sae(weights("relu", d=32), SITE)
    with pytest.raises(InputError, match="expected site="):
        tiny.attach_sae(weights("relu"))
    with pytest.raises(InputError, match="own site 'blocks.1.hook_resid_post'"):
        tiny.attach_sae(SAE(weights("relu"), SITE), "blocks.0.hook_resid_post")
    tc = SAE(weights("relu", transcoder=True, apply_b_dec_to_input=False), "blocks.1.hook_resid_mid",
             "blocks.1.hook_mlp_out")
    with pytest.raises(InputError, match="transcoder"):  # attached, it records; it has no reconstruction to splice in
        tiny.attach_sae(tc, splice=True)
    with pytest.raises(InputError, match="only with splice=True"):
        tiny.attach_sae(weights("relu"), SITE, keep_error=True)
    with pytest.raises(InputError, match="positions"):  # the splice's steering fails: its hook comes off too
        tiny.attach_sae(weights("relu"), SITE, splice=True, positions="first")


@pytest.mark.parametrize("arch,options", [("relu", {}), ("jumprelu", {}), ("topk", {}), ("gated", {}),
                                          ("relu", {"normalize_activations": "layer_norm"})],
                         ids=["relu", "jumprelu", "topk", "gated", "relu-layer_norm"])
def test_sub_sites_are_the_saes_own_math_bit_for_bit(clean, arch, options):
    tiny, w = clean, weights(arch, **options)
    with tiny.attach_sae(SAE(w, SITE, provenance=Provenance.from_model(tiny))) as h, \
            tiny.record([SITE] + h.names) as cache:
        tiny.forward(PROMPTS)  # padded rows: the SAE runs on the real tokens only
    x = rows(cache, SITE)
    assert x.shape[0] == 11 + 2 + 19
    inp, acts, recons, err = (rows(cache, n) for n in h.names)
    assert torch.equal(inp, x) and torch.equal(acts, w.encode(x))
    assert torch.equal(recons, w.reconstruct(x)) and torch.equal(err, w.error(x))
    assert 0 < int((acts != 0).sum()) < acts.numel()
    if arch == "topk":
        assert (acts != 0).sum(-1).eq(12).all()
    assert torch.equal(cache.positions(h.names[1]), cache.positions(SITE))
    with tiny.attach_sae(w, SITE) as h, tiny.record(h.names[1], positions="last") as last:  # one row a prompt
        tiny.forward(PROMPTS)
    assert last[h.names[1]].shape == (3, 256)
    torch.testing.assert_close(last[h.names[1]], w.encode(cache[SITE][torch.arange(3), cache.lengths(SITE) - 1]),
                               rtol=1e-5, atol=1e-6)


def test_an_sae_on_attention_heads(clean):
    tiny = clean
    site = "blocks.0.attn.hook_z"  # [batch, pos, 4 heads, 16]: the SAE reads the heads flattened
    w = weights("relu", d=64, flatten_heads=True)
    with tiny.attach_sae(w, site) as h, tiny.record([site] + h.names[:2]) as cache:
        tiny.forward(PROMPTS)
    z = rows(cache, site)
    assert z.shape[1:] == (4, 16) and torch.equal(rows(cache, h.names[0]), z.flatten(-2))
    assert torch.equal(rows(cache, h.names[1]), w.encode(z.flatten(-2)))
    with tiny.attach_sae(w, site, splice=True), tiny.record(site) as spliced:
        tiny.forward(PROMPTS)
    assert rel(rows(spliced, site).flatten(-2), w.reconstruct(z.flatten(-2))) < 1e-6


def test_handles_come_off_after_exceptions(clean):
    tiny, w = clean, weights("topk")
    with tiny.record(SITE):  # a scope of the caller's, which must survive
        before = (tiny.hook_count(), len(tiny.hooks.handles))
        with pytest.raises(RuntimeError, match="boom"):
            with tiny.attach_sae(w, SITE, splice=True) as h, tiny.record(h.names) as cache:
                assert tiny.hook_count() == before[0] + 2 and len(tiny.hooks.handles) == before[1] + 3
                tiny.forward(PROMPTS)
                raise RuntimeError("boom")
        assert (tiny.hook_count(), len(tiny.hooks.handles), tiny.hooks.saes) == (*before, {})
        assert not h.active and not h.splice.active and cache[h.names[1]].shape[0] == 3  # the recording stays readable
        with pytest.raises(InputError, match="positions"):  # an error raised by a forward pass inside the scopes
            with tiny.attach_sae(w, SITE) as h, tiny.record(h.names[1], positions=[99]):
                tiny.forward(PROMPTS)
        assert (tiny.hook_count(), len(tiny.hooks.handles), tiny.hooks.saes) == (*before, {})
        h = tiny.attach_sae(w, SITE)
        tiny.reset()  # the escape hatch removes the SAE too
        assert not h.active and tiny.hooks.saes == {} and tiny.hook_count() == 0


def test_the_splice_is_an_edit_that_composes(clean):
    tiny, w = clean, weights("jumprelu")
    with tiny.record(SITE) as plain:
        base = tiny.forward(PROMPTS)
    x = rows(plain, SITE)
    with tiny.attach_sae(w, SITE, splice=True) as h, tiny.record([SITE] + h.names) as cache:
        spliced = tiny.forward(PROMPTS)
    assert torch.equal(rows(cache, h.names[0]), x)  # the SAE reads the activation the splice replaces
    assert rel(rows(cache, SITE), rows(cache, h.names[2])) < 1e-6  # the site now holds the reconstruction
    assert (spliced - base).abs().max() > 1e-2
    with tiny.attach_sae(w, SITE, splice=True, keep_error=True):  # reconstruction + error: the activation again
        kept = tiny.forward(PROMPTS)
    torch.testing.assert_close(kept, base, atol=1e-4, rtol=0)
    v = torch.randn(64, generator=torch.Generator().manual_seed(3))
    with tiny.attach_sae(w, SITE, splice=True), tiny.steer(steerkit.Intervention.add(SITE, v)), \
            tiny.record(SITE) as both:
        tiny.forward(PROMPTS)
    assert rel(rows(both, SITE), w.reconstruct(x) + v) < 1e-6  # the splice, then the steering registered after it
    with tiny.attach_sae(w, SITE, splice=True, positions="last"), tiny.record(SITE) as last:
        tiny.forward(PROMPTS)
    n = last.lengths(SITE)
    for b in range(3):
        got, want = last[SITE][b, : int(n[b])], plain[SITE][b, : int(n[b])]
        assert torch.equal(got[:-1], want[:-1]) and rel(got[-1], w.reconstruct(want[-1])) < 1e-6
    with tiny.steer(splice_intervention(w, SITE)):  # the same edit without an attached SAE
        assert torch.equal(tiny.forward(PROMPTS), spliced)


def test_sparse_dataset_and_the_old_format(clean, tmp_path):
    tiny, w = clean, weights("topk")
    acts = f"{SITE}.hook_sae_acts_post"
    with tiny.attach_sae(w, SITE):
        ds = record_dataset(tiny, PROMPTS * 3, [SITE, acts], tmp_path / "all", positions="all", batch_size=2,
                            shard_size=4, progress=False)
        last = record_dataset(tiny, PROMPTS * 3, [SITE, acts], tmp_path / "last", positions="last", batch_size=3,
                              shard_size=4, progress=False)
    man = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert man["format"] == FORMAT_SPARSE and man["sparse"] == {acts: 256}
    assert man["saes"][SITE]["d_sae"] == 256 and len(man["saes"][SITE]["sha256"]) == 16
    dense, x = ds.load(acts), ds.load(SITE)
    assert dense.shape == (x.shape[0], 256) and (dense != 0).sum(-1).eq(12).all()
    # each batch is one pass: its rows are the SAE's on that pass's rows, bit for bit (9 prompts in shards of 4)
    for batches, data in (([2, 2, 2, 2, 1], ds), ([3, 1, 3, 1, 1], last)):
        per_prompt = data.lengths(SITE).tolist() if data is ds else [1] * 9
        a, i = 0, 0
        for n in batches:
            k = sum(per_prompt[i:i + n])
            assert torch.equal(data.load(acts)[a:a + k], w.encode(data.load(SITE)[a:a + k]))
            a, i = a + k, i + n
        assert a == data.load(SITE).shape[0]
    csr = ds.load(acts, sparse=True)
    assert csr.layout == torch.sparse_csr and torch.equal(csr.to_dense(), dense)
    assert all(p.layout == torch.sparse_csr for p in ds.iter(acts, sparse=True))
    with pytest.raises(InputError, match="stored dense"):
        ds.load(SITE, sparse=True)
    assert torch.equal(last[acts, 4], last.load(acts)[4]) and torch.equal(last[acts, -1], last.load(acts)[-1])
    # a recording without SAE sites is format 1, as before, and reads as before
    plain = record_dataset(tiny, PROMPTS, [SITE], tmp_path / "plain", positions="last", progress=False)
    assert plain.meta["format"] == FORMAT and "saes" not in plain.meta and plain.sparse == {}
    assert torch.equal(ActivationDataset(tmp_path / "plain").load(SITE), last.load(SITE)[:3])
    # resuming the same folder with another SAE is refused
    with tiny.attach_sae(weights("topk", seed=1), SITE):
        with pytest.raises(InputError, match="saes"):
            record_dataset(tiny, PROMPTS * 3, [SITE, acts], tmp_path / "all", positions="all", batch_size=2,
                           shard_size=4, progress=False)


@pytest.mark.slow
def test_default_model_latents_bit_for_bit_and_in_generation(sm):
    site = "blocks.10.hook_resid_post"
    w = weights("jumprelu", d=sm.d_model, d_sae=2048, seed=5)
    topk = weights("topk", d=sm.d_model, d_sae=2048, seed=6)
    prompts = ["The capital of France is", "Once upon a time, in a land far away,"]
    sae = SAE(w, site, provenance=Provenance.from_model(sm))
    with sm.attach_sae(sae) as h, sm.attach_sae(topk, "blocks.20.hook_resid_post") as h2, \
            sm.record([site, h.names[1], "blocks.20.hook_resid_post", h2.names[1]]) as cache:
        sm.forward(prompts)
    x = rows(cache, site)
    assert torch.equal(rows(cache, h.names[1]), w.encode(x))
    assert torch.equal(rows(cache, h2.names[1]), topk.encode(rows(cache, "blocks.20.hook_resid_post")))
    assert 0 < float((rows(cache, h.names[1]) != 0).float().mean()) < 0.9
    # KV-cached generation: the latents of every position, prompt and generated, as a full forward pass has them
    with sm.attach_sae(sae) as h, sm.attach_sae(topk, "blocks.20.hook_resid_post") as h2, \
            sm.record([h.names[1], h2.names[1], "blocks.20.hook_resid_post"]) as gen:
        out = sm.generate(prompts, max_new_tokens=4, return_tokens=True)
    full_ids = [sm.tokenizer(p)["input_ids"] + o for p, o in zip(prompts, out)]
    with sm.attach_sae(sae) as h, sm.attach_sae(topk, "blocks.20.hook_resid_post") as h2, \
            sm.record([h.names[1], h2.names[1]]) as full:
        sm.forward(sm.pad(full_ids))
    assert gen.lengths(h.names[1]).tolist() == [len(i) for i in full_ids] == full.lengths(h.names[1]).tolist()
    assert rel(rows(gen, h.names[1]), rows(full, h.names[1])) < 1e-5
    # TopK: the same latents selected, and equal values, wherever no near-tie sits at the k-th place
    g_acts, f_acts = rows(gen, h2.names[1]), rows(full, h2.names[1])
    pre = topk.pre_acts(rows(gen, "blocks.20.hook_resid_post")).topk(13, -1).values
    clear = (pre[:, 11] - pre[:, 12]) > 1e-3
    assert int(clear.sum()) >= 0.9 * clear.numel()
    assert torch.equal(g_acts[clear] != 0, f_acts[clear] != 0)
    assert rel(g_acts[clear], f_acts[clear]) < 1e-5
    assert sm.hook_count() == 0 and not sm.hooks.saes


def test_the_old_module_of_sae_sites_warns_with_the_new_one():
    import steerkit.hooks.saesites as old
    import steerkit.saesites as new

    with pytest.warns(DeprecationWarning, match="steerkit.saesites.SAEHandle"):
        assert old.SAEHandle is new.SAEHandle
    with pytest.raises(AttributeError):
        old.__wrapped__  # noqa: B018 - dunder names are not forwarded
