"""The explorer as ``steerkit app`` serves it: waitress (``steerkit.apps.app.make_server``), one process,
over real HTTP on 127.0.0.1.

The app (a tiny random model, tests/support/tiny_models.py) is served by :func:`make_server` in a thread of this
process, and raw requests (``http.client``, so that any ``Host`` can be sent) check what holds at the
socket: a page for 127.0.0.1 is answered 200 by waitress; a foreign ``Host`` or ``Origin`` gets 403 and
reaches no callback; a body over ``MAX_REQUEST_BYTES`` gets 413 whether its length is declared or it is
sent in chunks; a background job started over HTTP finishes and its result is fetched. ``run`` serves
through :func:`make_server` (the development server only with ``debug``). Regression tests of what
benchmarks/soak_app.py found run through the same server.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

pytest.importorskip("dash", reason="the app extra (dash) is not installed")
pytest.importorskip("waitress", reason="the app extra (waitress) is not installed")

from steerkit.apps import app as app_module  # noqa: E402
from steerkit.apps.data import MAX_REQUEST_BYTES  # noqa: E402
from steerkit.errors import InputError  # noqa: E402
from _servers import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import steerkit
    from tiny_models import tiny_model
    m, tok = tiny_model("llama")
    sm = steerkit.wrap(m, tok, name="tiny-llama")
    root = tmp_path_factory.mktemp("served")
    (root / "results").mkdir()
    (root / "results" / "mi_one.json").write_text(json.dumps({"mi": [0.1, 0.5, 0.2]}))
    port = free_port()
    app = app_module.create_app(sm, store=str(root / "store"), results=str(root / "results"),
                                cache_dir=str(root / "cache"), port=port)
    server = app_module.make_server(app, "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    yield {"port": port, "app": app}
    server.close()
    thread.join(10)


def request(port, method, path, *, host=None, headers=None, body=None):
    """One raw request to 127.0.0.1:``port``: ``(status, headers, body)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def callback_body(app, first_output: str, values: dict) -> bytes:
    """A ``/_dash-update-component`` body for the callback whose outputs start with ``first_output``."""
    for key, spec in app.callback_map.items():
        outs = spec["output"] if isinstance(spec["output"], list) else [spec["output"]]
        outs = [{"id": o.component_id, "property": o.component_property} for o in outs]
        if f"{outs[0]['id']}.{outs[0]['property']}" == first_output:
            ins = [dict(i, value=values.get(f"{i['id']}.{i['property']}")) for i in spec["inputs"]]
            sts = [dict(i, value=values.get(f"{i['id']}.{i['property']}")) for i in spec["state"]]
            first = spec["inputs"][0]
            return json.dumps({"output": key, "outputs": outs if key.startswith("..") else outs[0], "inputs": ins,
                               "state": sts, "changedPropIds": [f"{first['id']}.{first['property']}"]}).encode()
    raise KeyError(first_output)


def test_a_page_for_this_machine_is_served_by_waitress(served):
    status, headers, body = request(served["port"], "GET", "/")
    assert status == 200 and b"<title>steerkit explorer</title>" in body
    assert headers.get("Server") == "steerkit"  # waitress' ident, not Werkzeug's development server
    status, _, body = request(served["port"], "GET", "/_dash-layout", host=f"localhost:{served['port']}")
    assert status == 200 and b"prof-run" in body


@pytest.mark.parametrize("host, origin", [("evil.example:{port}", None), ("127.0.0.1.evil.example:{port}", None),
                                          ("127.0.0.1:1", None), ("127.0.0.1:{port}", "http://evil.example:{port}"),
                                          ("127.0.0.1:{port}", "null")])
def test_a_foreign_host_or_origin_gets_403_over_http(served, host, origin):
    port = served["port"]
    headers = {"Origin": origin.format(port=port)} if origin else {}
    status, _, body = request(port, "GET", "/", host=host.format(port=port), headers=headers)
    assert status == 403 and b"forbidden" in body
    cb = callback_body(served["app"], "probe-file.options", {})
    status, _, body = request(port, "POST", "/_dash-update-component", host=host.format(port=port),
                              headers={**headers, "Content-Type": "application/json"}, body=cb)
    assert status == 403 and b"response" not in body


def test_an_oversize_body_gets_413_declared_or_chunked(served):
    port = served["port"]
    # declared: refused on the Content-Length header, before the body is read
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", "/_dash-update-component", skip_host=True)
    conn.putheader("Host", f"127.0.0.1:{port}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_REQUEST_BYTES + 1))
    conn.endheaders(b"{")
    assert conn.getresponse().status == 413
    conn.close()
    # chunked: refused once the chunks pass the limit
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest("POST", "/_dash-update-component", skip_host=True)
    conn.putheader("Host", f"127.0.0.1:{port}")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * (1 << 20)
    try:
        for _ in range(MAX_REQUEST_BYTES // len(chunk) + 2):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
    except OSError:  # the server may close the connection as soon as it has answered
        pass
    assert conn.getresponse().status == 413
    conn.close()
    # a body under the limit is answered
    status, _, _ = request(port, "POST", "/_dash-update-component", headers={"Content-Type": "application/json"},
                           body=callback_body(served["app"], "probe-file.options", {}))
    assert status == 200


def run_job(port, app, first_output: str, values: dict) -> dict:
    """POST a background callback over HTTP, poll it until its answer comes, return the answer's
    ``response``."""
    body = callback_body(app, first_output, values)
    json_type = {"Content-Type": "application/json"}
    status, _, raw = request(port, "POST", "/_dash-update-component", headers=json_type, body=body)
    assert status == 200
    started = json.loads(raw)
    assert {"cacheKey", "job"} <= set(started)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        status, _, raw = request(port, "POST", f"/_dash-update-component?cacheKey={started['cacheKey']}"
                                 f"&job={started['job']}", headers=json_type, body=body)
        assert status == 200
        answer = json.loads(raw)
        if "response" in answer:
            return answer["response"]
        time.sleep(0.1)
    raise AssertionError(f"no answer from {first_output} within 120 s")


PROFILE = {"prof-run.n_clicks": 1, "prof-contrast.value": "temporal", "prof-n.value": 2, "steer-op.value": "add",
           "steer-strength.value": 4}


def test_a_background_job_over_http_finishes_and_is_fetched(served):
    """A divergence profile (a background callback) over real HTTP: started, polled, its result fetched,
    its thread gone."""
    port, app = served["port"], served["app"]
    text = json.dumps(run_job(port, app, "prof-key.data", PROFILE)["prof-status"])
    assert "2 pairs" in text and "ok-message" in text, text
    counts = app._background_manager.job_counts()
    assert counts["started"] >= 1 and counts["running"] == 0 and counts["finished"] == counts["started"]


def test_a_5000_digit_number_in_a_pasted_list_is_a_message(served):
    """Found by benchmarks/soak_app.py: the Profiles page answered "Unexpected error (ValueError): Exceeds the
    limit (4300 digits) for integer string conversion" for a pasted JSON list holding a 5,000-digit number."""
    response = run_job(served["port"], served["app"], "prof-key.data",
                       {**PROFILE, "prof-contrast.value": "custom", "prof-a.value": "[" + "9" * 5000 + "]",
                        "prof-b.value": "one"})
    text = json.dumps(response["prof-status"])
    assert "error-message" in text and "list A" in text and "5000 digits" in text, text[:500]
    assert "Unexpected error" not in text and "set_int_max_str_digits" not in text


def test_digits_that_int_refuses_in_picker_values_are_a_message(served, monkeypatch):
    """``"²".isdigit()`` is true but ``int("²")`` raises: a profile direction at layer "²" and an MI pick "²:..."
    are refused as values the page did not offer, not as unexpected errors."""
    from steerkit.apps.pages.common import Context
    from steerkit.apps.pages.steer import resolve_direction
    port, app = served["port"], served["app"]
    key = run_job(port, app, "prof-key.data", {**PROFILE, "prof-n.value": 1})["prof-key"]["data"]["key"]
    ctx = Context.of(app.steerkit_env)
    assert 0 in resolve_direction(ctx, f"profile:{key}:0")[0]
    for layer in ("²", "٣", "01", "9" * 500):
        with pytest.raises(InputError, match="expected a layer of the profile"):
            resolve_direction(ctx, f"profile:{key}:{layer}")
    status, _, raw = request(port, "POST", "/_dash-update-component", headers={"Content-Type": "application/json"},
                             body=callback_body(app, "diag-mi.figure", {"diag-mi-pick.value": "²:mi_one.json"}))
    text = json.dumps(json.loads(raw)["response"]["diag-mi-status"])
    assert status == 200 and "error-message" in text and "Unexpected error" not in text, text[:300]


def test_the_time_limit_counts_model_work_not_the_wait_for_another_job(served, monkeypatch):
    """A profile that waits 3 s for the model (another job holds it) and then computes in well under a second
    is answered, with a time limit of 2 s per request: the limit starts with its own work."""
    port, app = served["port"], served["app"]
    env = app.steerkit_env
    monkeypatch.setattr(env, "deadline", 2.0)
    answers = []
    with env.host.lock:  # another job's model work
        t = threading.Thread(target=lambda: answers.append(run_job(port, app, "prof-key.data", {
            **PROFILE, "prof-contrast.value": "harmful", "prof-n.value": 1})))
        t.start()
        time.sleep(3.0)
    t.join(120)
    text = json.dumps(answers[0]["prof-status"])
    assert "ok-message" in text and "1 pairs" in text, text[:400]


def test_a_job_nobody_asks_about_is_cancelled_and_a_polled_one_runs_on(tmp_path):
    """A page polls its job (Dash calls ``job_running`` on every poll); a job whose page went away is
    cancelled after ``abandoned_after`` seconds without a poll, one that is polled is not."""
    import diskcache

    from steerkit.apps.runtime import ThreadedDiskcacheManager, should_stop
    mgr = ThreadedDiskcacheManager(diskcache.Cache(str(tmp_path)), abandoned_after=0.5)
    stopped = {}

    def job_fn(key, progress_key, args, context):
        end = time.monotonic() + 60
        while not should_stop() and time.monotonic() < end:
            time.sleep(0.02)
        stopped[args] = should_stop()

    left, polled = mgr.call_job_fn("k1", job_fn, "left", {}), mgr.call_job_fn("k2", job_fn, "polled", {})
    end = time.monotonic() + 30
    while "left" not in stopped and time.monotonic() < end:
        assert mgr.job_running(polled)
        time.sleep(0.1)
    assert stopped == {"left": True}
    assert mgr.job_running(polled) and not mgr.job_running(left)
    mgr.terminate_job(polled)  # the Cancel button
    while mgr.job_counts()["running"] and time.monotonic() < end:
        time.sleep(0.05)
    assert stopped == {"left": True, "polled": True}
    assert mgr.job_counts() == {"started": 2, "finished": 2, "cancelled": 1, "abandoned": 1, "running": 0}


def test_run_serves_with_waitress_and_debug_with_the_development_server(monkeypatch):
    made, ran = [], []

    class FakeApp:
        def run(self, **kw):
            ran.append(kw)

    class FakeServer:
        def run(self):
            ran.append("waitress")

    monkeypatch.setattr(app_module, "create_app", lambda *a, **k: FakeApp())
    monkeypatch.setattr(app_module, "make_server", lambda app, host, port: made.append((host, port)) or FakeServer())
    app_module.run("m", host="127.0.0.1", port=8123)
    assert made == [("127.0.0.1", 8123)] and ran == ["waitress"]
    app_module.run("m", host="127.0.0.1", port=8123, debug=True)
    assert made == [("127.0.0.1", 8123)] and ran[-1]["debug"] is True


def test_the_apps_own_cache_folder_goes_with_it(tmp_path, monkeypatch):
    """With no ``cache_dir``, the app makes a cache folder of its own for background jobs and removes it when it
    closes (``weakref.finalize``: at exit at the latest), so app starts leave nothing in the temporary folder; a
    ``cache_dir`` it was given stays."""
    import tempfile
    import weakref
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    app = app_module.create_app(preload=False)
    made = list((tmp_path / "tmp").iterdir())
    assert [p.name[:19] for p in made] == ["steerkit-app-cache-"], made
    assert isinstance(app.steerkit_close, weakref.finalize) and app.steerkit_close.atexit
    app.steerkit_close()
    assert not made[0].exists() and not app.steerkit_close.alive
    given = tmp_path / "given"
    app = app_module.create_app(preload=False, cache_dir=str(given))
    app.steerkit_close()
    assert given.is_dir()
