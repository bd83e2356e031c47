"""Requests to a Dash app through Flask's test client, as the browser sends them: a callback's body, its
background job awaited, a page's run, and hypothesis' random values for every input (the fuzz)."""
from __future__ import annotations

import contextlib
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PORT = 8050
BASE = f"http://127.0.0.1:{PORT}"

NASTY = ["/dev/zero", "../../etc/passwd", "/etc/passwd", "0:/dev/zero", "0:../../etc/passwd", "upload",
         "fifo_sweep.json", "zero_sweep.json", "link_sweep.json", "linkdir/secret_sweep.json", "mi_fifo.json",
         "0:mi_zero.json", "store:../../x", "store:sec-dir@1", "profile:abc:1", "__default__", "/proc/self/environ",
         "sub/good_sweep.json", "0:mi_good.json", "all", "0-999999999", "temporal", "custom", "steered", "harmful",
         "add", "ablate", "clamp", "safetensors", "/profiles", "/probes", "/store"]
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.sampled_from(NASTY),
                   st.just("A" * 300_000), st.just("data:text/plain;base64," + "QUFB" * 500_000),
                   st.just({"key": "x" * 100}), st.just({"name": "n", "text": "layer,auroc\n1,0.5"}))
VALUES = st.recursive(LEAVES, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                      max_leaves=8)



def _outputs(spec):
    outs = spec["output"] if isinstance(spec["output"], list) else [spec["output"]]
    return [{"id": o.component_id, "property": o.component_property} for o in outs]


def callback_key(app, first_output: str) -> str:
    """The callback_map key of the callback whose outputs start with ``first_output`` (id.prop)."""
    for k, v in app.callback_map.items():
        o = _outputs(v)[0]
        if f"{o['id']}.{o['property']}" == first_output:
            return k
    raise KeyError(first_output)


def body_for(app, key: str, values: dict, changed=None) -> dict:
    """A ``/_dash-update-component`` body for callback ``key`` with ``values`` ({"id.prop": v})."""
    spec = app.callback_map[key]
    outs = _outputs(spec)
    ins = [dict(i, value=values.get(f"{i['id']}.{i['property']}")) for i in spec["inputs"]]
    sts = [dict(i, value=values.get(f"{i['id']}.{i['property']}")) for i in spec["state"]]
    first = spec["inputs"][0]
    return {"output": key, "outputs": outs if key.startswith("..") else outs[0], "inputs": ins, "state": sts,
            "changedPropIds": [changed or f"{first['id']}.{first['property']}"]}


def wait_jobs(app, timeout=60.0):
    mgr = app._background_manager  # the app's ThreadedDiskcacheManager
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with mgr._jobs_lock:
            threads = [t for t, _ in mgr._jobs.values()]
        if not threads:
            return
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
    raise AssertionError("background jobs still running")


def post(client, app, key, values, changed=None, headers=None, base_url=BASE):
    """POST one callback; for a background callback, wait for its job and fetch the result."""
    body = body_for(app, key, values, changed)
    r = client.post("/_dash-update-component", json=body, headers=headers or {}, base_url=base_url)
    if r.status_code == 200 and r.is_json and "cacheKey" in (r.get_json() or {}):
        j = r.get_json()
        wait_jobs(app)
        for _ in range(50):
            r = client.post(f"/_dash-update-component?cacheKey={j['cacheKey']}&job={j['job']}", json=body,
                            base_url=base_url)
            if r.status_code != 200 or not r.is_json or "cacheKey" not in (r.get_json() or {}) \
                    or "response" in r.get_json():
                break
            time.sleep(0.05)
    return r


def run_page(app, client, page: str, good: dict, changes: dict):
    """POST a page's run callback (``{page}-key.data``) with its ``good`` inputs, ``changes`` (keyword names,
    ``_`` for ``-``) replacing some; asserts HTTP 200."""
    vals = dict(good, **{f"{page}-{k.replace('_', '-')}.value": v for k, v in changes.items()})
    r = post(client, app, callback_key(app, f"{page}-key.data"), vals)
    assert r.status_code == 200, r.data[:300]
    return r


def draw_request(app, key, data) -> tuple[dict, str]:
    """A fuzz request for callback ``key``: random values for its inputs and states (``VALUES``) and the
    input that changed, drawn through hypothesis' ``data``."""
    spec = app.callback_map[key]
    props = [f"{i['id']}.{i['property']}" for i in spec["inputs"] + spec["state"]]
    values = {p: data.draw(VALUES, label=p) for p in props}
    changed = data.draw(st.sampled_from([f"{i['id']}.{i['property']}" for i in spec["inputs"]]))
    return values, changed


def strings(o) -> str:
    """Every string in a JSON value (the messages a page would show), joined."""
    if isinstance(o, str):
        return o
    if isinstance(o, dict):
        return " ".join(strings(v) for v in o.values())
    if isinstance(o, list):
        return " ".join(strings(v) for v in o)
    return ""


def text_of(r) -> str:
    return strings(r.get_json()) if r.is_json else r.data.decode("utf-8", "replace")


def status_message(r, component: str) -> str:
    return strings(r.get_json().get("response", {}).get(component, {}))


def callbacks_of(app, prefix: str) -> list[str]:
    """The keys of the callbacks with an input or state whose id starts with ``prefix`` (a page's)."""
    return [k for k, v in app.callback_map.items()
            if any(str(i["id"]).startswith(prefix) for i in v["inputs"] + v["state"])]


def fuzz_callbacks(app, client, keys, *, seconds: float, examples: int, tweak=None, watch=None) -> list[int]:
    """Post random requests (:func:`draw_request`) to the callbacks ``keys`` for at most ``seconds`` and
    ``examples``: each must answer below HTTP 500 and show no traceback. ``tweak(values, data)`` may change a
    drawn request first; ``watch`` (a reusable context manager) is entered around each post. Returns the
    statuses (at least one)."""
    statuses: list[int] = []
    t_end = time.monotonic() + seconds

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(list(keys)), st.data())
    def one(key, data):
        if time.monotonic() > t_end:
            return
        values, changed = draw_request(app, key, data)
        if tweak is not None:
            tweak(values, data)
        with watch if watch is not None else contextlib.nullcontext():
            r = post(client, app, key, values, changed=changed)
        statuses.append(r.status_code)
        assert r.status_code < 500, (key, r.status_code, r.data[:500])
        assert "Traceback" not in (strings(r.get_json()) if r.is_json else ""), (key, r.data[:500])

    one()
    assert statuses and max(statuses) < 500
    return statuses
