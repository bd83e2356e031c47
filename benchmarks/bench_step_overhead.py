"""What steering adds to one decoding step, with the conditions interleaved step by step.

End-to-end generation runs (``bench_generation.py``) on a shared 2-core VM scatter by +-10% between
identical runs, so a 3% target cannot be resolved from a few dozen generations. Here one prompt
batch is prefilled, the KV cache grown to ``--context`` tokens, and then the same decoding step
(one new token, KV cache cropped back after it) is timed over and over, cycling through the
conditions in rotated order, so that each steered step has an unsteered step next to it in time:

  base         no hooks
  add          steerkit ``sm.edit("blocks.15.hook_resid_post", add=v)``
  ablate       steerkit ``sm.edit([every block's hook_resid_post], ablate=u)`` (30 sites)
  torch-ablate the same ablation as bare ``register_forward_hook`` closures of two torch ops each
               (``addmm(x, x @ u^T, u, alpha=-1)``): the floor any hook-based library pays
  base-2       no hooks again: the A/A control, whose "overhead" is what noise alone produces

Overheads are medians of the per-round ratio steered / base, with a bootstrap 95% interval.
Also printed: the time of one steerkit hook call measured inside the model (the interpreter's data
is out of the CPU caches there, so a call costs several times its time in a tight loop).

Usage: python benchmarks/bench_step_overhead.py [--batches 1,8] [--rounds 300] [--context 64] [--quick]

Rows go to ``benchmarks/results/step_overhead.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LAYER = 15


def run_batch(sm, B: int, rounds: int, context: int, log) -> dict:
    import torch
    import steerkit
    import steerkit.backends._torch as BT

    d, n = sm.d_model, sm.n_layers
    v, u = C.steering_vectors(d)
    blocks = [sm.adapter.block(sm.hf_model, l) for l in range(n)]
    uT, u1 = u[:, None].contiguous(), u[None, :].contiguous()

    def torch_ablate(mod, args, out):
        x2 = out.reshape(-1, d)
        return torch.addmm(x2, x2 @ uT, u1, alpha=-1).view(out.shape)

    add = sm.compile([steerkit.Intervention.add(f"blocks.{LAYER}.hook_resid_post", v)])
    abl = sm.compile([steerkit.Intervention.ablate(f"blocks.{l}.hook_resid_post", u) for l in range(n)])

    class Torch:
        def __init__(self):
            self.hs = [b.register_forward_hook(torch_ablate) for b in blocks]

        def remove(self):
            for h in self.hs:
                h.remove()

    conds = {"base": lambda: None, "add": lambda: sm.hooks.install(add), "ablate": lambda: sm.hooks.install(abl),
             "torch-ablate": Torch, "base-2": lambda: None}
    # time each steerkit hook call inside the model (wraps the hook function the backend registers)
    per_call: dict[str, list[float]] = {}
    current = ["base"]
    orig = BT.TorchHooks._edit_output

    def timed_edit_output(self, module, fn, tracker):
        def tfn(x, call):
            t0 = time.perf_counter()
            y = fn(x, call)
            per_call.setdefault(current[0], []).append(time.perf_counter() - t0)
            return y
        return orig(self, module, tfn, tracker)

    res = {c: [] for c in conds}
    be = sm.backend
    toks = sm.pad([sm.tokenize(p, chat=True).input_ids[0].tolist() for p in C.prompts(B)])
    BT.TorchHooks._edit_output = timed_edit_output
    try:
        with torch.inference_mode(), sm.hooks.runs.running(toks.attention_mask, toks.input_ids) as run:
            cache = be.new_cache()
            logits, cache = be.step(toks.input_ids, toks.attention_mask, toks.position_ids, cache)
            mask, pos = toks.attention_mask, toks.position_ids[:, -1:] + 1
            for _ in range(context):
                mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
                logits, cache = be.step(logits.argmax(-1)[:, None], mask, pos, cache)
                pos = pos + 1
            L = cache.get_seq_length()
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], 1)
            nxt = logits.argmax(-1)[:, None]
            names = list(conds)
            for r in range(rounds + 1):  # round 0 warms every condition up and is dropped
                for c in names[r % len(names):] + names[:r % len(names)]:
                    h = conds[c]()
                    current[0] = c
                    try:
                        run.chunk_start = L
                        t0 = time.process_time()
                        _, cache = be.step(nxt, mask, pos, cache)
                        dt = time.process_time() - t0
                    finally:
                        if h is not None:
                            h.remove()
                    cache.crop(-1)
                    if r:
                        res[c].append(dt)
                if r and r % 50 == 0:
                    log(f"    B={B}: {r}/{rounds} rounds")
    finally:
        BT.TorchHooks._edit_output = orig
    return {"times": res, "per_call": per_call}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--context", type=int, default=64, help="KV-cache length the timed step extends")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="batch 1, 10 rounds, 16-token context (a smoke run)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "step_overhead.csv"),
                    help="CSV of the rows (one per batch and condition)")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.rounds, a.context = "1", 10, 16
    import steerkit

    threads = C.set_threads(a.threads)
    sm = steerkit.load_model()

    def log(s: str) -> None:
        print(s, flush=True)

    log(f"model {sm.name}: {sm.n_layers} layers; {threads} thread(s); {a.rounds} rounds per batch; "
        f"context {a.context} tokens")
    rows, out_rows = [], []
    for B in [int(b) for b in a.batches.split(",")]:
        out = run_batch(sm, B, a.rounds, a.context, log)
        t = out["times"]
        base = t["base"]
        for c in ("add", "ablate", "torch-ablate", "base-2"):
            ratios = [s / b - 1 for s, b in zip(t[c], base)]
            lo, hi = C.boot_ci(ratios)
            calls = out["per_call"].get(c)
            rows.append([B, c, f"{statistics.median(base) * 1e3:.1f}", f"{statistics.median(t[c]) * 1e3:.1f}",
                         f"{statistics.median(ratios) * 100:+.2f}%", f"[{lo * 100:+.2f}, {hi * 100:+.2f}]",
                         f"{statistics.median(calls) * 1e6:.0f}" if calls else "-"])
            out_rows.append({"mode": "quick" if a.quick else "full", "batch": B, "condition": c, "rounds": a.rounds,
                             "context": a.context, "base_ms": round(statistics.median(base) * 1e3, 3),
                             "cond_ms": round(statistics.median(t[c]) * 1e3, 3),
                             "overhead_pct": round(statistics.median(ratios) * 100, 3),
                             "ci_lo_pct": round(lo * 100, 3), "ci_hi_pct": round(hi * 100, 3),
                             "hook_us_per_call": round(statistics.median(calls) * 1e6, 1) if calls else "",
                             "threads": threads})
    print()
    print(C.table(["batch", "condition", "base cpu ms/step", "cond cpu ms/step", "paired overhead (median)",
                   "95% CI", "steerkit hook us/call (in model)"], rows,
                  title="One decoding step, conditions interleaved step by step (CPU time, one thread)"))
    print(f"wrote {len(out_rows)} rows to {C.csv_rows(Path(a.out), out_rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
