"""The explorer trusts no request: confined file reads, the Host / Origin check, bounded inputs.

Every test drives the Dash server through Flask's test client (no browser, no network) with a
tiny random model (tests/support/tiny_models.py). Regression tests cover each attack --
picker values naming /dev/zero, a FIFO, a symbolic link, ``../`` or an absolute path; a foreign
``Host`` or ``Origin`` (DNS rebinding); a 12,000-row sweep table of new layers and positions; an
upload value posted past the upload callback; an oversize Steer prompt; a picker value naming a
model path -- and a hypothesis fuzz posts random values for every input of every callback.
"""
from __future__ import annotations

import base64
import builtins
import json
import os
import site
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("dash", reason="the app extra (dash) is not installed")


from steerkit.apps import data as limits  # noqa: E402
from steerkit.apps import io as saved  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from dash_requests import (BASE, body_for, callback_key, fuzz_callbacks, post, status_message,  # noqa: E402
                           text_of)

pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ 1. confined reads
@pytest.mark.parametrize("name", ["fifo_sweep.json", "zero_sweep.json", "link_sweep.json", "linkdir/secret_sweep.json",
                                  "/dev/zero", "/proc/self/environ", "../outside/secret_sweep.json",
                                  "sub/../../outside/secret_sweep.json"])
def test_sweep_reads_refuse_fifo_device_link_and_escapes_quickly(folders, name):
    t = time.monotonic()
    with pytest.raises(saved.NotAResult) as e:
        saved.read_sweep(folders["results"], name)
    assert time.monotonic() - t < 2.0  # never blocks on the FIFO, never reads /dev/zero
    assert str(e.value) == str(saved.not_a_result("sweep table"))


def test_mi_reads_refuse_fifo_device_link_and_escapes(folders):
    for name in ("mi_fifo.json", "mi_zero.json", "/dev/zero", "../outside/mi_secret.json", "linkdir/mi_secret.json"):
        t = time.monotonic()
        with pytest.raises(saved.NotAResult):
            saved.read_mi_all(folders["results"], name)
        assert time.monotonic() - t < 2.0
    assert saved.read_mi_all(folders["results"], "mi_good.json")[0].mi.tolist() == [0.1, 0.5, 0.2]


def test_scans_list_only_regular_files_inside(folders):
    assert saved.scan_sweeps(folders["results"]) == ["sub/good_sweep.json"]
    assert [r for r, _ in saved.scan_mi(folders["results"])] == ["mi_good.json"]
    assert saved.read_sweep(folders["results"], "sub/good_sweep.json").layers == [0, 1]
    # the notebook readers confine the read to the file's own folder (no FIFO, no link)
    with pytest.raises(OSError):
        saved.load_sweep(folders["results"] / "fifo_sweep.json")
    with pytest.raises(OSError):
        saved.load_sweep(folders["results"] / "zero_sweep.json")


def test_picker_values_get_one_message_for_existing_and_missing_files(app, client, folders):
    key = callback_key(app, "probe-heatmap.figure")

    def msg(value):
        r = post(client, app, key, {"probe-file.value": value})
        assert r.status_code == 200
        return status_message(r, "probe-status")
    pairs = [("../outside/secret_sweep.json", "../outside/missing_sweep.json"),
             (str(folders["outside"] / "secret_sweep.json"), str(folders["outside"] / "missing_sweep.json")),
             ("/etc/passwd", "/etc/no-such-file"), ("/dev/zero", "/dev/no-such-device"),
             ("link_sweep.json", "nothing_sweep.json"), ("fifo_sweep.json", "zero_sweep.json")]
    for existing, missing in pairs:
        a, b = msg(existing), msg(missing)
        assert a == b
        assert "expected a sweep table of this app" in a and "secret" not in a and "passwd" not in a
    assert "best AUROC" in msg("sub/good_sweep.json")
    mi = callback_key(app, "diag-mi.figure")

    def mi_msg(value):
        r = post(client, app, mi, {"diag-mi-pick.value": value})
        assert r.status_code == 200
        return status_message(r, "diag-mi-status")
    for existing, missing in (("0:../outside/mi_secret.json", "0:../outside/mi_missing.json"),
                              (f"0:{folders['outside'] / 'mi_secret.json'}", "0:/nowhere/mi.json"),
                              ("0:/dev/zero", "0:/etc/passwd"), ("0:mi_fifo.json", "0:mi_zero.json")):
        assert mi_msg(existing) == mi_msg(missing)
        assert "expected a MI result of this app" in mi_msg(existing)
    assert "3 steps" in mi_msg("0:mi_good.json")


def test_picker_options_are_relative_names(app, client):
    r = post(client, app, callback_key(app, "probe-file.options"), {"url.pathname": "/probes"})
    opts = r.get_json()["response"]["probe-file"]["options"]
    assert [o["value"] for o in opts] == ["sub/good_sweep.json"]
    r = post(client, app, callback_key(app, "diag-mi-pick.options"), {"url.pathname": "/diagnostics"})
    assert [o["value"] for o in r.get_json()["response"]["diag-mi-pick"]["options"]] == ["0:mi_good.json"]


# ------------------------------------------------------------------ 2. Host / Origin
@pytest.mark.parametrize("headers", [{"Host": "evil.example:8050"}, {"Host": "127.0.0.1.evil.example:8050"},
                                     {"Host": "localhost:9999"}, {"Host": "evil.example"}, {"Host": ""},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://evil.example:8050"},
                                     {"Host": "127.0.0.1:8050", "Origin": "null"},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://127.0.0.1:9999"}])
def test_foreign_host_or_origin_gets_403_and_reaches_no_callback(app, client, monkeypatch, headers):
    calls = []
    real = saved.read_sweep
    monkeypatch.setattr(saved, "read_sweep", lambda *a, **k: calls.append(a) or real(*a, **k))
    for path in ("/", "/_dash-layout", "/_dash-dependencies"):
        assert client.get(path, headers=headers, base_url=BASE).status_code == 403
    body = body_for(app, callback_key(app, "probe-heatmap.figure"), {"probe-file.value": "sub/good_sweep.json"})
    r = client.post("/_dash-update-component", json=body, headers=headers, base_url=BASE)
    assert r.status_code == 403 and b"forbidden" in r.data and b"response" not in r.data
    assert calls == []


@pytest.mark.parametrize("headers", [{}, {"Host": "localhost:8050"}, {"Host": "[::1]:8050"},
                                     {"Host": "127.0.0.1:8050", "Origin": "http://127.0.0.1:8050"},
                                     {"Host": "localhost:8050", "Origin": "http://localhost:8050"}])
def test_local_host_and_origin_are_answered(app, client, headers):
    assert client.get("/", headers=headers, base_url=BASE).status_code == 200
    body = body_for(app, callback_key(app, "probe-heatmap.figure"), {"probe-file.value": "sub/good_sweep.json"})
    r = client.post("/_dash-update-component", json=body, headers=headers, base_url=BASE)
    assert r.status_code == 200 and "best AUROC" in text_of(r)


def test_allowed_hosts_from_the_command_line():
    from steerkit.apps.app import allowed_hosts, host_allowed, origin_allowed
    a = allowed_hosts(8050, "192.168.1.5", ["box.lan", "proxy.example:443"])
    assert host_allowed("192.168.1.5:8050", a) and host_allowed("box.lan:8050", a)
    assert host_allowed("proxy.example:443", a) and not host_allowed("proxy.example:8050", a)
    assert origin_allowed("https://proxy.example", a) and not origin_allowed("https://evil.example", a)
    assert not host_allowed("0.0.0.0:8050", allowed_hosts(8050, "0.0.0.0"))
    with pytest.raises(InputError):
        allowed_hosts(8050, None, ["bad host/with/slash"])
    from steerkit.cli.app import register
    import argparse
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    register(sub)
    args = p.parse_args(["app", "--allowed-host", "a.lan", "--allowed-host", "b.lan:9"])
    assert args.allowed_host == ["a.lan", "b.lan:9"]


# ------------------------------------------------------------------ 3. bounded work
def _rows_table(n, new_layers=True):
    return json.dumps({"rows": [{"layer": i if new_layers else i % 4, "position": f"p{i}" if new_layers else "last",
                                 "auroc": 0.5} for i in range(n)]}, separators=(",", ":"))


def test_a_12000_row_table_of_new_layers_and_positions_is_refused_cheaply():
    import psutil
    text = _rows_table(12_000)
    assert len(text) < 700_000
    rss = psutil.Process().memory_info().rss
    t = time.monotonic()
    with pytest.raises(InputError, match=f"at most {limits.MAX_SWEEP_LAYERS} layers x {limits.MAX_SWEEP_POSITIONS} "
                                         "positions"):
        saved.parse_sweep(text, "big")
    assert time.monotonic() - t < 5.0
    assert psutil.Process().memory_info().rss - rss < 200 << 20
    with pytest.raises(InputError, match=f"at most {limits.MAX_SWEEP_ROWS} rows"):
        saved.parse_sweep(_rows_table(limits.MAX_SWEEP_ROWS + 1, new_layers=False), "long")
    csv = "layer,position,auroc\n" + "".join(f"{i},p{i},0.5\n" for i in range(12_000))
    with pytest.raises(InputError, match="layers x"):
        saved.parse_sweep(csv, "big.csv")
    grid = json.dumps({"layers": list(range(600)), "positions": ["last"], "auroc": [[0.5]] * 600})
    with pytest.raises(InputError, match="layers x"):
        saved.parse_sweep(grid, "grid")


def test_the_big_table_through_the_upload_is_a_message(app, client):
    text = _rows_table(12_000)
    contents = "data:application/json;base64," + base64.b64encode(text.encode()).decode()
    r = post(client, app, callback_key(app, "probe-upload-data.data"), {"probe-upload.contents": contents,
                                                                 "probe-upload.filename": "big_sweep.json"})
    assert r.status_code == 200 and "layers x" in text_of(r) and len(r.data) < 100_000


def test_upload_values_posted_directly_are_bounded_where_they_are_read(app, client):
    big = base64.b64encode(b"a\n" * (limits.UPLOAD_MAX_BYTES // 2 + 10)).decode()
    for side in ("a", "b"):
        r = post(client, app, callback_key(app, f"prof-{side}.value"),
                 {f"prof-upload-{side}.contents": "data:text/plain;base64," + big, f"prof-upload-{side}.filename": "x"})
        assert r.status_code == 200 and f"at most {limits.UPLOAD_MAX_BYTES >> 10} KiB" in text_of(r)
    r = post(client, app, callback_key(app, "probe-upload-data.data"), {"probe-upload.contents": "data:,"
                                                                 + "QUFB" * 2_000_000})
    assert r.status_code == 200 and "at most 1024 KiB" in text_of(r)
    # the upload store's value, posted past the upload callback
    r = post(client, app, callback_key(app, "probe-heatmap.figure"),
             {"probe-file.value": "upload", "probe-upload-data.data": {"name": "x", "text": "a" * (2 << 20)}})
    assert r.status_code == 200 and "at most 1024 KiB" in text_of(r)


def test_pasted_lists_and_layer_ranges_are_bounded():
    with pytest.raises(InputError, match=f"at most {limits.MAX_PROMPT_LIST_CHARS} characters"):
        limits.parse_prompt_text("x" * (limits.MAX_PROMPT_LIST_CHARS + 1))
    with pytest.raises(InputError, match=f"at most {limits.MAX_PAIRS} prompts"):
        limits.parse_prompt_text("\n".join(["p"] * (limits.MAX_PAIRS + 1)))
    t = time.monotonic()
    with pytest.raises(InputError, match="range"):
        limits.parse_layers("0-1000000000", 30)
    with pytest.raises(InputError):
        limits.parse_layers(list(range(10 ** 6)), 30)
    assert time.monotonic() - t < 1.0


def test_steer_prompt_tokens_and_pairs_are_bounded(app, client):
    key = callback_key(app, "steer-base.children")
    vals = {"steer-run.n_clicks": 1, "steer-strength.value": 4, "steer-artifact.value": "store:x",
            "steer-layers.value": "1", "steer-op.value": "add", "steer-max.value": 8}
    r = post(client, app, key, dict(vals, **{"steer-prompt.value": "x" * 20_000}))
    assert r.status_code == 200 and f"at most {limits.MAX_STEER_PROMPT_CHARS} characters" in text_of(r)
    r = post(client, app, key, dict(vals, **{"steer-prompt.value": "hi", "steer-max.value": 100_000}))
    assert f"from 1 to {limits.MAX_NEW_TOKENS}" in text_of(r)
    r = post(client, app, callback_key(app, "prof-key.data"), {"prof-run.n_clicks": 1, "prof-contrast.value": "temporal",
                                                       "prof-n.value": 10 ** 9})
    assert f"from 1 to {limits.MAX_BUILTIN_PAIRS}" in text_of(r)


def test_generation_stops_at_the_deadline_with_what_it_has(tiny):
    import numpy as np
    from steerkit.apps import analysis
    setting = analysis.steer_setting(tiny, np.ones(tiny.d_model), "1")
    full = analysis.steer_compare(tiny, "hello", setting, max_new_tokens=8)
    assert not full.stopped_at_deadline
    cut = analysis.steer_compare(tiny, "hello", setting, max_new_tokens=8, deadline=0.0)
    assert cut.stopped_at_deadline and cut.baseline_tokens == [] and not tiny.hooks.handles
    # a deadline in the middle: the tokens made before it, each with its projection
    real = time.monotonic
    calls = {"n": 0}

    def clock():
        calls["n"] += 1
        return real() + (100.0 if calls["n"] > 6 else 0.0)
    analysis.time.monotonic = clock
    try:
        mid = analysis.steer_compare(tiny, "hello", setting, max_new_tokens=8, deadline=50.0)
    finally:
        analysis.time.monotonic = real
    assert mid.stopped_at_deadline and 0 < len(mid.baseline_tokens) < 8
    assert len(mid.baseline_proj) == len(mid.baseline_tokens) and len(mid.steered_proj) == len(mid.steered_tokens)
    assert mid.baseline_tokens == full.baseline_tokens[:len(mid.baseline_tokens)]


def test_the_steer_page_says_when_it_stopped_at_the_deadline(app, client, tiny):
    import torch
    from steerkit.vectors import SteeringVector, Store
    env = app.steerkit_env
    Store(env.store_path).save("sec-dir", SteeringVector.from_direction(torch.ones(tiny.d_model), 1, tiny))
    vals = {"steer-run.n_clicks": 1, "steer-strength.value": 2, "steer-artifact.value": "store:sec-dir@1",
            "steer-layers.value": "1", "steer-op.value": "add", "steer-max.value": 6, "steer-prompt.value": "hey"}
    old = env.deadline
    env.deadline = 0.0
    try:
        r = post(client, app, callback_key(app, "steer-base.children"), vals)
    finally:
        env.deadline = old
    assert r.status_code == 200 and "Stopped at the time limit of 0 s" in text_of(r)
    r = post(client, app, callback_key(app, "steer-base.children"), vals)
    assert "Stopped" not in text_of(r) and "layers 1" in text_of(r)  # the cut result was not cached


def test_the_model_picker_refuses_a_path_it_did_not_list(app, client, monkeypatch, folders):
    host = app.steerkit_env.host
    calls = []
    monkeypatch.setattr(host, "switch", lambda spec: calls.append(spec) or (_ for _ in ()).throw(
        InputError("not loading in this test")))
    key = callback_key(app, "model-label.children")
    for value in ("/etc", str(folders["outside"]), "../../models/x", "someone/else-model", 7, ["a"]):
        r = post(client, app, key, {"model-load.n_clicks": 1, "model-pick.value": value, "model-path.value": ""})
        assert r.status_code == 200 and "expected one of the models listed in the picker" in text_of(r)
    assert calls == []
    r = post(client, app, key, {"model-load.n_clicks": 1, "model-pick.value": "__default__", "model-path.value": "x" * 5000})
    assert f"at most {limits.MAX_MODEL_PATH_CHARS} characters" in text_of(r) and calls == []
    # the typed path still loads (here: the spy), and the default is listed
    post(client, app, key, {"model-load.n_clicks": 1, "model-pick.value": "__default__",
                            "model-path.value": str(folders["outside"])})
    post(client, app, key, {"model-load.n_clicks": 1, "model-pick.value": "__default__", "model-path.value": ""})
    assert calls == [str(folders["outside"]), None]


def test_request_bodies_are_bounded(app, client):
    r = client.post("/_dash-update-component", data=b"x" * (limits.MAX_REQUEST_BYTES + 1),
                    content_type="application/json", base_url=BASE)
    assert r.status_code == 413


# ------------------------------------------------------------------ 4. the fuzz
class OpenLog:
    """Every path opened through ``builtins.open`` / ``os.open`` while active (any thread)."""

    def __init__(self):
        self.paths: list[str] = []
        self._open, self._os_open = builtins.open, os.open

    def __enter__(self):
        log, real_open, real_os_open = self.paths, self._open, self._os_open

        def where(p, dir_fd=None):
            if isinstance(p, int):
                return None
            p = os.fsdecode(p)
            if dir_fd is not None and not os.path.isabs(p):
                try:
                    p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
                except OSError:
                    pass
            return os.path.abspath(p)

        def fake_open(file, *a, **k):
            w = where(file)
            if w:
                log.append(w)
            return real_open(file, *a, **k)

        def fake_os_open(path, flags, mode=0o777, *, dir_fd=None):
            w = where(path, dir_fd)
            if w:
                log.append(w)
            return real_os_open(path, flags, mode, dir_fd=dir_fd)
        builtins.open, os.open = fake_open, fake_os_open
        return self

    def __exit__(self, *exc):
        builtins.open, os.open = self._open, self._os_open


def test_fuzz_every_callback_input(app, client, folders, monkeypatch):
    import psutil
    host = app.steerkit_env.host
    switched = []
    monkeypatch.setattr(host, "switch", lambda spec: switched.append(spec) or (_ for _ in ()).throw(
        InputError("not loading in the fuzz")))
    keys = sorted(app.callback_map)
    typed: list = []
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    log = OpenLog()  # only the app's work is watched, not hypothesis' own files

    def remember_typed(values, data):
        if "model-path.value" in values:
            typed.append(values["model-path.value"])
    statuses = fuzz_callbacks(app, client, keys, seconds=60, examples=300, tweak=remember_typed, watch=log)
    print(f"fuzz: {len(statuses)} requests, statuses {sorted(set(statuses))}, {len(log.paths)} opens")
    assert any(p.startswith(str(Path(folders["results"]).resolve())) for p in log.paths)  # the watch works
    growth = proc.memory_info().rss - rss0
    assert growth < 500 << 20, f"resident memory grew by {growth >> 20} MiB"
    allowed = [str(Path(folders[k]).resolve()) for k in ("results", "store", "cache")]
    allowed += [os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
                                              site.getusersitepackages()}]
    allowed += ["/dev/null", "/dev/urandom", "/proc/self", f"/proc/{os.getpid()}", "/sys/devices/system/cpu",
                "/sys/fs/cgroup"]
    outside = sorted({p for p in log.paths if not any(os.path.realpath(p) == a or os.path.realpath(p).startswith(a + "/")
                                                     or p.startswith(a + "/") for a in allowed)})
    assert not outside, f"opened outside the app's folders: {outside[:20]}"
    for opened in log.paths:
        assert not opened.startswith(str(folders["outside"])), opened
        assert os.path.realpath(opened) not in ("/dev/zero", "/etc/passwd")
    # the picker loaded nothing it did not list: only the default or a value typed into the box
    typed_ok = {t.strip() for t in typed if isinstance(t, str)}
    assert all(s is None or s in typed_ok for s in switched), switched
