"""GPU benchmark: the steering operator's cost inside a CUDA-graph replay.

vLLM's plugin steers compiled engines through one operator per site whose body is
:func:`steerkit.kernels.slots.steer_slots_`, reading persistent buffers: on CUDA one launch of the fused Triton
kernel over the whole slots table, in place, with a device flag that makes a site with nothing to steer one read,
no host branch, so it can be captured. The slots are the plugin's own default size
(:data:`steerkit.serving.plan.SLOT_DEFAULTS`: 512 configurations, 8 directions each). This script
checks that on a GPU without vLLM: a stack of ``--layers`` decoder-like blocks (two matmuls each,
``d_model`` x ``4 d_model``, with a residual pair like vLLM's ``(hidden, residual)``) decodes a batch
of ``--tokens`` rows, captured once in a CUDA graph

* ``base``: the blocks alone;
* ``op-idle``: the blocks with the operator at every block and every token unsteered (index -1);
* ``op-steered``: the same graph (not re-captured) after the buffers were refilled so every token
  is steered (each row its own configuration among 8: an ablation of 4 directions plus an injection);

and replays each ``--reps`` times in rotated rounds, reporting the median milliseconds per replay
and the operator's overhead against ``base``. It also checks that the replayed, steered output
equals the same blocks run eagerly with :func:`steerkit.kernels.fused_steer_ref` (float32:
atol 1e-4), i.e. that the captured graph really reads the refilled buffers.

Usage:  python benchmarks/gpu_steer_graph.py                  # on one CUDA GPU, about a minute
        python benchmarks/gpu_steer_graph.py --quick          # 8 blocks, fewer replays
        python benchmarks/gpu_steer_graph.py --smoke          # CPU: the arithmetic check only, no graph
Needs torch and steerkit installed (scripts/gpu_check.sh installs it without dependencies). Writes ``benchmarks/results/gpu_steer_graph.csv`` (``--out``) and ``$OUT/gpu_steer_graph.json``
when ``OUT`` is set. Not run on the CPU-only machines the project is developed on.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402  (standard library only)

# installed: scripts/gpu_check.sh installs steerkit without dependencies
from steerkit.kernels import SteerConfig, SteerTable, fused_steer_ref, orthonormalize  # noqa: E402
from steerkit.kernels.slots import SteerSlots, steer_slots_  # noqa: E402
from steerkit.serving.plan import SLOT_DEFAULTS  # noqa: E402


def build(d: int, layers: int, tokens: int, device, dtype, configs: int = 8, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    W1 = [(torch.randn(d, 4 * d, generator=g) / d ** 0.5).to(device, dtype) for _ in range(layers)]
    W2 = [(torch.randn(4 * d, d, generator=g) / (4 * d) ** 0.5).to(device, dtype) for _ in range(layers)]
    cfgs = [SteerConfig(basis=orthonormalize(torch.randn(4, d, generator=g)), add=torch.randn(d, generator=g),
                        add_scale=0.5) for _ in range(configs)]
    table = SteerTable.from_configs(cfgs, d_model=d)
    slots = SteerSlots(d_model=d, device=device, dtype=torch.float32, **SLOT_DEFAULTS)  # the plugin's default size
    for l in range(layers):
        slots.load(table, l * configs)
    cfg = torch.full((layers, tokens), -1, dtype=torch.long, device=device)
    flag = torch.zeros(layers, dtype=torch.int32, device=device)
    x0 = torch.randn(tokens, d, generator=g).to(device, dtype)
    return W1, W2, table, slots, cfg, flag, x0


def blocks(x0, W1, W2, steer=None):
    hidden, residual = x0.clone(), torch.zeros_like(x0)
    for l, (a, b) in enumerate(zip(W1, W2)):
        residual = hidden + residual
        hidden = torch.relu(residual @ a) @ b
        if steer is not None:
            steer(l, hidden, residual)
    return hidden + residual


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="rows of the decoding step (requests)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="8 blocks, 50 replays x 3 rounds")
    ap.add_argument("--smoke", action="store_true", help="CPU, small sizes: the arithmetic check only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_steer_graph.csv"))
    a = ap.parse_args()
    if a.quick:
        a.layers, a.reps, a.rounds = 8, 50, 3
    if a.smoke:
        a.d_model, a.layers, a.tokens, device = 64, 2, 8, torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_steer_graph.py needs a CUDA GPU (or --smoke for the CPU check)")
    else:
        device = torch.device("cuda")
    dtype = getattr(torch, a.dtype)
    if a.layers * 8 > SLOT_DEFAULTS["configs"]:
        raise SystemExit(f"--layers {a.layers}: 8 configurations a layer do not fit {SLOT_DEFAULTS['configs']} slots")
    W1, W2, table, slots, cfg, flag, x0 = build(a.d_model, a.layers, a.tokens, device, dtype)
    row_cfg = torch.arange(a.tokens, device=device) % 8

    def op(l, hidden, residual):
        steer_slots_(hidden, residual, cfg[l], flag[l], slots)  # what a captured engine runs: every stage but region

    def fill(steered: bool):
        cfg.fill_(-1)
        flag.fill_(1 if steered else 0)
        if steered:
            for l in range(a.layers):
                cfg[l].copy_(l * 8 + row_cfg)

    def reference():
        def ref(l, hidden, residual):
            new = fused_steer_ref((hidden + residual).float(), table, row_cfg, None).to(residual.dtype)
            residual.copy_(new)
            hidden.zero_()
        return blocks(x0, W1, W2, ref)

    fill(True)
    eager_out = blocks(x0, W1, W2, op)
    want = reference()
    err = float((eager_out.float() - want.float()).abs().max())
    tol = 1e-4 * max(1.0, float(want.abs().max())) if dtype == torch.float32 else 5e-2 * float(want.abs().max())
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "d_model": a.d_model,
              "layers": a.layers, "tokens": a.tokens, "dtype": a.dtype, "eager_max_abs_err": err}
    print(f"eager operator vs fused_steer_ref: max |diff| {err:.2e} (tol {tol:.1e})")
    if err > tol:
        raise SystemExit("the operator does not match the reference")
    if a.smoke:
        print(json.dumps(result))
        return

    graphs, outs = {}, {}
    for name, steer in (("base", None), ("op", op)):
        fill(False)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                blocks(x0, W1, W2, steer)
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            outs[name] = blocks(x0, W1, W2, steer)
        graphs[name] = gr
    # the captured graph reads the refilled buffers: steer every token, replay, compare
    fill(True)
    graphs["op"].replay()
    torch.cuda.synchronize()
    gerr = float((outs["op"].float() - want.float()).abs().max())
    result["graph_max_abs_err"] = gerr
    print(f"CUDA-graph replay (buffers refilled after capture) vs reference: max |diff| {gerr:.2e}")
    if gerr > tol:
        raise SystemExit("the captured graph does not steer by the refilled buffers")

    def time_replay(name: str, steered: bool) -> float:
        fill(steered)
        gr = graphs[name]
        for _ in range(10):
            gr.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(a.reps):
            gr.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / a.reps

    conds = [("base", "base", False), ("op-idle", "op", False), ("op-steered", "op", True)]
    times: dict = {c: [] for c, _, _ in conds}
    for r in range(a.rounds):
        for c, name, steered in conds[r % 3:] + conds[: r % 3]:
            times[c].append(time_replay(name, steered))
    base = statistics.median(times["base"])
    rows = []
    for c, _, _ in conds:
        ms = statistics.median(times[c])
        rows.append({"mode": "quick" if a.quick else "full",
                     **{k: result[k] for k in ("device", "d_model", "layers", "tokens", "dtype")}, "condition": c,
                     "ms_per_replay": round(ms, 4), "overhead_pct": round(100 * (ms / base - 1), 2),
                     "op_us_per_site": round(1e3 * (ms - base) / a.layers, 2) if c != "base" else 0.0})
        print(f"{c:>11}: {ms:.3f} ms per replay, {rows[-1]['overhead_pct']:+.2f}% vs base")
    result["rows"] = rows
    C.csv_rows(Path(a.out), rows)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_steer_graph.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
