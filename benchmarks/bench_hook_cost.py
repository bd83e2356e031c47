"""What steering costs per generation step, measured where the noise is small.

End-to-end ratios of steered / unsteered generation on a shared 2-core machine scatter by +-10%
(see docs/BENCHMARKS.md), more than the 3% target. This script measures, side by side in one run
and on CPU time with one torch thread:

1. the unsteered decode step time of the default model (median over many steps, batch 1 and 8);
2. the time of ONE call of the exact hook function steerkit registers for each edit (position
   tracker + mask + fused edit) on a tensor of the decode step's shape, over thousands of calls;
3. the implied overhead = n_sites x (2) / (1), for add at one layer and ablate at all 30 blocks;
4. the end-to-end ratio as well, with interleaved repeats, for reference.

Caveat: (2) is timed in a tight loop, where the interpreter's data stays in the CPU caches; inside a
decode step the same call costs several times more (``bench_step_overhead.py`` times it there and
measures the overhead step by step), so (3) is a lower bound.

Usage: python benchmarks/bench_hook_cost.py [--tokens 16] [--repeats 5]
       python benchmarks/bench_hook_cost.py --quick     # 4 tokens, 1 repeat, 500 calls

Rows go to ``benchmarks/results/hook_cost.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 new tokens, 1 repeat, 500 hook calls")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "hook_cost.csv"), help="CSV of the rows")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.calls = 4, 1, 500
    torch.set_num_threads(1)
    import steerkit
    from steerkit.hooks.manager import PositionTracker
    from steerkit.hooks.positions import RunState

    sm = steerkit.load_model()
    d, n = sm.d_model, sm.n_layers
    g = torch.Generator().manual_seed(0)
    v = torch.randn(d, generator=g)
    u = steerkit.orthonormalize(torch.randn(1, d, generator=g))
    I = steerkit.Intervention
    edits = {"add (1 site)": (lambda h: I.add(h, v, 4.0), 1), f"ablate ({n} sites)": (lambda h: I.ablate(h, u), n)}
    prompts = ["Tell me about your weekend.", "Describe the city you live in.", "Write about Mondays.",
               "What is a good breakfast?", "Explain rain to a child.", "Name a famous painter.",
               "How do birds fly?", "Give me a tip for learning."]
    out = []
    print(f"{'batch':>5} {'edit':16} {'step ms':>8} {'hook us/call':>13} {'implied':>8} {'end-to-end':>11}")
    for bs in (1, 8):
        P = prompts[:bs]

        def gen(P: list[str] = P) -> float:
            t = time.process_time()
            sm.generate(P, max_new_tokens=args.tokens, chat=True)
            return time.process_time() - t
        gen()
        # one hook call, exactly as registered by the hook manager, on a decode-step tensor
        x = torch.randn(bs, 1, d)

        class Holder:
            run = RunState(torch.ones(bs, 30, dtype=torch.long), 1)
        for name, (make, sites) in edits.items():
            tr = PositionTracker(Holder())
            tr.run_id, tr.offset = 1, 40
            fn = next(iter(sm.compile([make("blocks.15.hook_resid_post")]).programs.values()))  # the hook function
            with torch.inference_mode():
                for _ in range(200):
                    tr.offset = 40
                    fn(x, tr.call(x))
                t = time.process_time()
                for _ in range(args.calls):
                    tr.offset = 40
                    fn(x, tr.call(x))
                per_call = (time.process_time() - t) / args.calls
            hooks = [f"blocks.{l}.hook_resid_post" for l in range(sites)] if sites > 1 else ["blocks.15.hook_resid_post"]
            base, steered = [], []
            for _ in range(args.repeats):
                base.append(gen())
                with sm.steer([make(h) for h in hooks]):
                    steered.append(gen())
            step = statistics.median(base) / args.tokens
            implied = sites * per_call / step
            e2e = statistics.median(steered) / statistics.median(base) - 1
            print(f"{bs:>5} {name:16} {step * 1e3:8.1f} {per_call * 1e6:13.1f} {100 * implied:+7.2f}% {100 * e2e:+10.1f}%",
                  flush=True)
            out.append({"mode": "quick" if args.quick else "full", "batch": bs, "edit": name, "sites": sites,
                        "step_ms": round(step * 1e3, 2), "hook_us_per_call": round(per_call * 1e6, 2),
                        "implied_overhead_pct": round(100 * implied, 3), "end_to_end_overhead_pct": round(100 * e2e, 2),
                        "tokens": args.tokens, "repeats": args.repeats, "calls": args.calls})
    print(f"wrote {len(out)} rows to {C.csv_rows(Path(args.out), out)}")


if __name__ == "__main__":
    main()
