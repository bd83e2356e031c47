"""benchmarks/soak_serve.py without vLLM: its request mix (every well-formed spec is accepted and every
malformed one refused by steerkit's own checks), its outcome classifier (through fake openai clients
raising the client's real exceptions), its summaries and its process-tree sampler."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx2
import openai
import pytest

from steerkit.serving import vllm_plugin
from steerkit.serving.spec import MAX_ARTIFACTS, MAX_FLOATS, MAX_OPS, MAX_SPEC_CHARS, SpecError, parse_spec, resolve
from steerkit.vectors import Store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_serve", ROOT / "benchmarks" / "soak_serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look the module up there
    spec.loader.exec_module(mod)
    return mod


def context(soak, tiny, **kw):
    prompts = [("Hello there.", [1, 2, 3]), ("Tell me a story.", [4, 5, 6, 7]), ("Why?", [8])]
    return soak.Context(prompts=prompts, cond_prompts=prompts[:2], d_model=tiny.d_model, n_layers=tiny.n_layers,
                        max_spec_chars=MAX_SPEC_CHARS, max_floats=MAX_FLOATS, max_artifacts=MAX_ARTIFACTS,
                        max_ops=MAX_OPS, max_body=MAX_SPEC_CHARS + 4096, **kw)


def test_mix_parsing(soak):
    assert soak.parse_mix(soak.DEFAULT_MIX)["unsteered"] == 4.0
    assert soak.parse_mix("inline=1, disconnect=0") == {"inline": 1.0, "disconnect": 0.0}
    for bad in ("unsteered=1,teapot=2", "unsteered=x", "unsteered=-1", "unsteered=0", "unsteered=nan"):
        with pytest.raises(SystemExit):
            soak.parse_mix(bad)


def test_request_mix_follows_the_weights_and_every_spec_is_what_its_kind_says(soak, tiny, tmp_path):
    """1,500 draws: each kind in proportion to its weight; each well-formed spec parses and (inline) resolves
    against a model; each malformed one is refused by steerkit's own parse / resolve with a SpecError."""
    ctx = context(soak, tiny)
    weights = soak.parse_mix(soak.DEFAULT_MIX)
    rng = random.Random(0)
    plans = [soak.plan_request(rng, weights, ctx) for _ in range(1500)]
    counts = Counter(p.kind for p in plans)
    total = sum(weights.values())
    for kind, w in weights.items():
        assert abs(counts[kind] / 1500 - w / total) < 0.04, (kind, counts)
    assert 0.4 < sum(p.stream for p in plans if p.kind != "disconnect") / sum(p.kind != "disconnect" for p in plans) < 0.6
    assert {p.endpoint for p in plans} == {"completions", "chat"}
    store = Store(tmp_path / "store")  # empty: every named artifact is unknown here
    variants, seen = Counter(), set()
    for p in plans:
        variants[p.kind, p.variant] += 1
        if (p.kind, p.variant, p.spec) in seen:  # the large specs are one object each: checked once
            continue
        seen.add((p.kind, p.variant, p.spec))
        pool = ctx.cond_prompts if p.kind == "conditional" else ctx.prompts
        assert 0 <= p.prompt < len(pool)
        if p.kind == "unsteered":
            assert p.spec is None
        elif p.kind in ("artifact", "conditional"):
            refs = [a.ref for a in parse_spec(p.spec).artifacts]
            assert refs == (["cast@1"] if p.kind == "conditional" else [f"{p.variant}@1"]), p
        elif p.kind == "inline" and variants[p.kind, p.variant] <= 10:  # ten of each op resolve against a model
            assert resolve(parse_spec(p.spec), store=store, facts=tiny.facts).interventions
        if p.kind == "disconnect":
            assert (p.stream and 1 <= p.cut_after <= 3) or (not p.stream and p.give_up_s > 0)
        if p.kind == "bad_body":
            body = soak.bad_body(p.variant, "m", [5, 6], p.stream)
            with pytest.raises((ValueError, RecursionError, AssertionError)):
                obj = json.loads(body)
                assert isinstance(obj, dict) and isinstance(obj.get("vllm_xargs", {}), dict)
        elif p.kind in soak.MALFORMED:
            with pytest.raises(SpecError):
                resolve(parse_spec(p.spec), store=store, facts=tiny.facts)
        if p.variant == "body":
            assert len(p.spec) > ctx.max_body
    assert vllm_plugin.RequestCheck.MAX_BODY > MAX_SPEC_CHARS  # the script's body variant is past both limits
    for kind, names in (("bad_spec", soak.BAD_SPEC), ("unknown_artifact", soak.UNKNOWN), ("oversized", soak.OVERSIZED),
                        ("bad_body", soak.BAD_BODY)):
        assert {v for k, v in variants if k == kind} == set(names), kind
    assert len({p.spec for p in plans if p.kind == "inline"}) > 0.75 * counts["inline"]  # mostly new specs


def _request():
    return httpx2.Request("POST", "http://127.0.0.1:9/v1/completions")


class FakeStream:
    def __init__(self, n, fail=None):
        self.n, self.fail, self.closed = n, fail, False

    def __iter__(self):
        for i in range(self.n):
            yield {"chunk": i}
        if self.fail is not None:
            raise self.fail

    def close(self):
        self.closed = True


class FakeClient:
    """An openai client whose ``completions.create`` / ``chat.completions.create`` return or raise ``result``."""

    def __init__(self, result):
        self.completions = self
        self.chat = self
        self.result = result
        self.calls = []

    def create(self, **kw):
        self.calls.append(kw)
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def test_outcomes_are_classified_from_the_clients_own_exceptions(soak, tiny):
    ctx = context(soak, tiny)
    P = soak.Planned
    bad = P("bad_spec", "not_json", False, "completions", 0, "{", 4)
    good = P("artifact", "happy", True, "chat", 1, '{"artifacts":["happy@1"]}', 8)
    resp = httpx2.Response(400, request=_request())
    cases = [
        (bad, openai.BadRequestError("bad", response=resp, body=None), "status_4xx"),
        (bad, openai.InternalServerError("boom", response=httpx2.Response(500, request=_request()), body=None),
         "status_5xx"),
        (good, openai.APITimeoutError(request=_request()), "hung"),
        (good, openai.APIConnectionError(request=_request()), "conn_error"),
        (good, FakeStream(2, fail=openai.APIError("error event", request=_request(), body=None)), "stream_error"),
        (good, FakeStream(3), "ok"),
    ]
    for plan, result, want in cases:
        client = FakeClient(result)
        rec = soak.send(client, "m", plan, ctx)
        assert rec["outcome"] == want, (plan.kind, result, rec)
        assert (rec["outcome"] == soak.expected(plan.kind)) == (want in ("status_4xx", "ok"))
    kw = client.calls[0]
    assert kw["messages"] == [{"role": "user", "content": "Tell me a story."}] and kw["stream"]
    assert kw["extra_body"] == {"vllm_xargs": {"steerkit": good.spec}, "ignore_eos": True}
    stream = FakeStream(10)
    cut = P("disconnect", "none", True, "completions", 2, None, 8, cut_after=2)
    rec = soak.send(FakeClient(stream), "m", cut, ctx)
    assert rec["outcome"] == "disconnected" and stream.closed and rec["ttft_s"] is not None
    early = P("disconnect", "none", False, "completions", 2, None, 8, give_up_s=0.3)
    client = FakeClient(openai.APITimeoutError(request=_request()))
    client.with_options = lambda timeout: client if timeout == 0.3 else None
    assert soak.send(client, "m", early, ctx)["outcome"] == "disconnected"
    assert soak.acceptable("disconnect", "ok") and not soak.acceptable("disconnect", "status_5xx")


def test_summary_rows(soak):
    def rec(kind, outcome, latency, stream=False, ttft=None):
        return {"kind": kind, "outcome": outcome, "latency_s": latency, "stream": stream, "ttft_s": ttft}
    records = ([rec("unsteered", "ok", x) for x in (1.0, 2.0, 3.0)]
               + [rec("artifact", "ok", x, True, 0.5) for x in (2.0, 4.0, 6.0)] + [rec("artifact", "status_5xx", 0.1)]
               + [rec("bad_spec", "status_4xx", 0.01), rec("bad_spec", "ok", 2.0), rec("bad_spec", "hung", 60.0)])
    rows = {r["kind"]: r for r in soak.summarize(records, 10.0)}
    assert list(rows) == ["unsteered", "artifact", "bad_spec", "all"]
    u, a, b, al = rows["unsteered"], rows["artifact"], rows["bad_spec"], rows["all"]
    assert (u["requests"], u["ok"], u["unexpected"], u["p50_s"], u["p50_vs_unsteered"]) == (3, 3, 0, 2.0, 1.0)
    assert (a["ok"], a["status_5xx"], a["unexpected"], a["streamed"], a["p50_s"], a["p50_vs_unsteered"]) == \
        (3, 1, 1, 3, 4.0, 2.0)
    assert a["ttft_p50_s"] == 0.5 and a["p99_s"] == pytest.approx(5.96)
    assert (b["expected"], b["status_4xx"], b["ok"], b["hung"], b["unexpected"], b["p50_s"]) == \
        ("status_4xx", 1, 1, 1, 2, 0.01)
    assert (al["requests"], al["unexpected"], al["rps"]) == (10, 3, 1.0)


def test_resource_growth_and_token_agreement(soak):
    samples = [{"t_s": t, "rss_mib": rss, "fds": fds} for t, rss, fds in
               ((0, 100.0, 10), (10, 500.0, 40), (20, 520.0, 42), (30, 530.0, 41), (40, 540.0, 44))]
    g = soak.resource_growth(samples, warmup_s=15)
    assert (g["rss_warm_mib"], g["rss_end_mib"], g["rss_growth_mib"], g["fds_warm"], g["fd_growth"]) == \
        (520.0, 540.0, 20.0, 42, 2)
    assert g["rss_slope_mib_per_min"] == pytest.approx(60.0)
    assert soak.cut_at_stop([5, 6, 2, 7], {2}) == [5, 6]
    assert soak.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (False, 0.5)
    assert soak.agreement([1, 2], [1, 2]) == (True, 1.0)


def test_process_tree_usage_counts_children(soak):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for usage in (soak.tree_usage, soak._proc_tree_usage):
            rss, fds, n, own = usage(os.getpid())
            assert n >= 2 and rss > own > 10 and fds >= 3, usage
        assert soak.tree_usage(child.pid)[2] == 1
    finally:
        child.kill()
        child.wait()
