"""The steering operator's cost per call on the host path, as registered vs through a ``custom_op`` wrapper.

A compiled vLLM engine calls its steering operator (an engine's own, :class:`steerkit.serving.ops.ObjectOps`,
whose body is :func:`steerkit.kernels.slots.steer_slots_`) at every hooked site of every step (91 sites for the
default model), steered or not, so the cost of one call through the dispatcher matters. The operator is defined
with the dispatcher directly (``ObjectOps.define``); this script times it side by side with the same body
registered through ``torch.library.custom_op`` (the usual wrapper), in one process, on the CPU with one torch
thread, under ``torch.inference_mode`` (as in vLLM):

* ``idle``: a site no request steers in this step (its flag is 0);
* ``steered``: 16 rows (a decode batch of 16 requests), each steered by one of 8 injection
  configurations of the slots (the shape of ``bench_vllm.py``'s steered step at one site);
* for each, ``--calls`` calls (default 20,000; quick 2,000) timed as a whole after a warm-up, in
  ``--rounds`` rounds (default 5) alternating the two registrations; the median over rounds in
  microseconds per call (``time.perf_counter``).

Rows go to ``benchmarks/results/slots_op.csv``: ``us_per_call`` per (case, registration) and
``custom_op_over_define_op``.

Usage:  python benchmarks/bench_slots_op.py            # 20,000 calls x 5 rounds per case
        python benchmarks/bench_slots_op.py --quick    # 2,000 calls x 3 rounds
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 calls x 3 rounds")
    ap.add_argument("--calls", type=int, default=None, help="calls per timing (default 20000; quick 2000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 5; quick 3)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "slots_op.csv"))
    a = ap.parse_args(argv)
    calls = a.calls or (2000 if a.quick else 20000)
    rounds = a.rounds or (3 if a.quick else 5)

    import torch

    from steerkit.kernels import SteerConfig, SteerTable
    from steerkit.kernels import slots as S
    from steerkit.serving.ops import ObjectOps

    torch.set_num_threads(1)
    d, rows = 576, 16
    slots = S.SteerSlots(configs=512, d_model=d)
    g = torch.Generator().manual_seed(0)
    stages = slots.load(SteerTable.from_configs([SteerConfig.injection(torch.randn(d, generator=g))
                                                 for _ in range(8)]), offset=0)
    cfg_idle = torch.full((2048,), -1, dtype=torch.long)
    cfg_steer = cfg_idle.clone()
    cfg_steer[:rows] = torch.arange(rows) % 8
    off, on = torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
    hidden, residual = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)

    def body(hidden, residual, cfg, flag):
        S.steer_slots_(hidden, residual, cfg, flag, slots, stages=stages if int(flag) else (False,) * 4)

    @torch.library.custom_op("steerkit_bench::steer_resid_", mutates_args=("hidden", "residual"),
                             schema="(Tensor(a!) hidden, Tensor(b!) residual, Tensor cfg, Tensor flag) -> ()")
    def wrapped(hidden, residual, cfg, flag):
        body(hidden, residual, cfg, flag)

    ops = {"define_op": ObjectOps().define("steer_resid_(Tensor(a!) hidden, Tensor(b!) residual, Tensor cfg, "
                                           "Tensor flag) -> ()", body),
           "custom_op": torch.ops.steerkit_bench.steer_resid_}
    cases = {"idle": (cfg_idle, off), "steered": (cfg_steer, on)}
    times: dict = {(c, o): [] for c in cases for o in ops}
    with torch.inference_mode():
        for r in range(rounds):
            order = list(ops) if r % 2 == 0 else list(ops)[::-1]
            for case, (cfg, info) in cases.items():
                for name in order:
                    op = ops[name]
                    h, res = hidden.clone(), residual.clone()
                    for _ in range(200):
                        op(h, res, cfg, info)
                    t = time.perf_counter()
                    for _ in range(calls):
                        op(h, res, cfg, info)
                    times[(case, name)].append((time.perf_counter() - t) / calls * 1e6)
    out, table = [], []
    for case in cases:
        med = {o: statistics.median(times[(case, o)]) for o in ops}
        for o in ops:
            out.append({"mode": "quick" if a.quick else "full", "case": case, "registration": o, "rows": rows,
                        "calls": calls, "rounds": rounds, "us_per_call": round(med[o], 2),
                        "custom_op_over_define_op": round(med["custom_op"] / med["define_op"], 3)})
            table.append([case, o, f"{med[o]:.1f}"])
        print(f"{case}: custom_op / define_op = {med['custom_op'] / med['define_op']:.2f}x", flush=True)
    print(C.table(["case", "registration", "us / call"], table,
                  title=f"steering operator, host path, {calls} calls x {rounds} rounds (median)"))
    print(f"wrote {len(out)} rows to {C.csv_rows(Path(a.out), out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
