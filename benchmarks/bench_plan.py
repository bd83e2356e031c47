"""The vLLM plugin's planning cost per engine step, at 16 and 128 rows.

Every step the plugin turns the batch layout (each request's rows and absolute positions) into the
steering slots' indices (:meth:`steerkit.serving.slots.StepSlots.fill`): each request's steering, compiled once,
placed in the slots once, and per request and site the slot index of each of its rows (a decoding token's
computed once per steering), written for the whole step in one host buffer and copied to the buffers the
operators read. This script times exactly that, with the model's facts only (no weights, no vLLM), for steady
decode steps of ``R`` requests (one row each) and for a mixed step (two 64-token prefill chunks among the
decodes):

* ``R`` in ``--rows`` (default 16 and 128), the requests spread over ``--artifacts`` (8) distinct
  specs: an addition at block 12 (a different vector each), every other one also ablating a
  direction at every block's output, and a quarter of the requests unsteered;
* a step = ``StepSlots.fill`` of the step's requests (the plugin's default slot capacities);
* ``--steps`` (default 2,000; quick 200) steps timed one by one after a warm-up; median and 95th
  percentile in microseconds per step, on the process's CPU time (one torch thread).

Each spec is compiled once before the timing (as the plugin's request cache does); ``first_step_us`` is the
first step, which places every steering's tables in the slots.

Usage:  python benchmarks/bench_plan.py            # 16 and 128 rows, 2,000 steps each
        python benchmarks/bench_plan.py --quick    # 200 steps each
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="200 steps per case")
    ap.add_argument("--rows", default="16,128", help="requests per decode step (comma-separated)")
    ap.add_argument("--artifacts", type=int, default=8, help="distinct steering specs (default 8)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case (default 2000; quick 200)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "plan.csv"))
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from steerkit.interventions import Intervention, ModelFacts
    from steerkit.serving.plan import SLOT_DEFAULTS, Block
    from steerkit.serving.slots import StepSlots
    from steerkit.serving.spec import Resolved, compile_request

    threads = C.set_threads(a.threads)
    steps = a.steps or (200 if a.quick else 2000)
    L, D = 30, 576  # the default model's depth and width
    facts = ModelFacts(name="SmolLM2-135M-Instruct", n_layers=L, d_model=D, fingerprint=None)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    specs = []
    for k in range(a.artifacts):
        ivs = [Intervention.add("blocks.12.hook_resid_post", torch.randn(D, generator=g), 1.0 + k)]
        if k % 2:
            ivs += [Intervention.ablate(f"blocks.{l}.hook_resid_post", u) for l in range(L)]
        specs.append(Resolved(key=f"spec-{k}", interventions=tuple(ivs), compiled=compile_request(ivs, facts)))
    sites = [f"blocks.{l}.{kind}" for l in range(L) for kind in ("hook_resid_post", "hook_attn_out", "hook_mlp_out")]

    def blocks_for(R: int, prefill: int) -> list:
        out, start = [], 0
        for i in range(R):
            n = 64 if i < prefill else 1
            pos0 = 0 if i < prefill else 40 + i
            res = None if i % 4 == 3 else specs[i % a.artifacts]
            out.append(Block(start, start + n, np.arange(pos0, pos0 + n), 32 if i >= prefill else 96, res))
            start += n
        return out

    def one_step(blocks, slots):
        assert slots.fill(blocks, total=blocks[-1].end)

    rows = []
    table = []
    for R in [int(r) for r in a.rows.split(",")]:
        for kind, prefill in (("decode", 0), ("mixed", 2)):
            blocks = blocks_for(R, prefill)
            slots = StepSlots(["blocks.0.hook_resid_pre", *sites], d_model=D, max_tokens=2048, **SLOT_DEFAULTS)
            t0 = time.process_time()
            one_step(blocks, slots)
            first = (time.process_time() - t0) * 1e6
            for _ in range(20):
                one_step(blocks, slots)
            ts = []
            for _ in range(steps):
                t = time.process_time()
                one_step(blocks, slots)
                ts.append((time.process_time() - t) * 1e6)
            ts.sort()
            med, p95 = ts[len(ts) // 2], ts[int(0.95 * len(ts)) - 1]
            n_tok = blocks[-1].end
            steered = sum(b.resolved is not None for b in blocks)
            rows.append({"mode": "quick" if a.quick else "full", "step": kind, "requests": R, "tokens": n_tok,
                         "steered_requests": steered, "artifacts": a.artifacts, "steps": steps,
                         "median_us_per_step": round(med, 1), "p95_us_per_step": round(p95, 1),
                         "first_step_us": round(first, 1), "clock": "cpu", "threads": threads})
            table.append([kind, R, n_tok, steered, f"{med:.0f}", f"{p95:.0f}", f"{first / 1e3:.1f} ms"])
    print(C.table(["step", "requests", "tokens", "steered", "median us/step", "p95 us/step", "first step"],
                  table, title=f"StepSlots.fill, {a.artifacts} distinct specs, {steps} steps per case, "
                               f"CPU time, {threads} thread(s)"))
    print(f"rows written to {C.csv_rows(Path(a.out), rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
