"""Recording ``attn.hook_pattern`` at every layer vs recording ``hook_resid_post`` at every layer.

The prompts (``--prompts``, 64; chat template) are tokenized once into batches (``--batch``, 16).
For each batch three passes run back to back in rotated order: a bare ``sm.forward``; a forward
inside ``sm.record(<all 30 blocks.{l}.hook_resid_post>, positions="all")``; and a forward inside
``sm.record(<all 30 blocks.{l}.attn.hook_pattern>, positions="all")`` (on this SDPA model the
hooked attention modules compute their attention the eager way to expose the probabilities). Each
recorded pass includes reading every recorded tensor back (``cache[name]`` for every name, i.e. the
finished ``[batch, pos, d_model]`` / ``[batch, heads, pos, pos]`` tensors).

Throughput ratio = total time of the resid_post passes / total time of the pattern passes (1: as
cheap; below 1: patterns cost more), on the process's CPU time by default (one torch thread), the
wall-time ratio printed next to it; both against the bare pass as well. Rows go to
``benchmarks/results/pattern_record.csv``.

Usage:  python benchmarks/bench_pattern_record.py            # 64 prompts, batches of 16
        python benchmarks/bench_pattern_record.py --quick    # 16 prompts, batches of 8
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


Clock = C.Clock


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 prompts in batches of 8")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 64; quick 16)")
    ap.add_argument("--batch", type=int, default=None, help="prompts per batch (default 16; quick 8)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "pattern_record.csv"))
    a = ap.parse_args(argv)

    import torch

    import steerkit

    N = a.prompts or (16 if a.quick else 64)
    B = a.batch or (8 if a.quick else 16)
    threads = C.set_threads(a.threads)
    t0 = time.perf_counter()
    sm = steerkit.load_model()
    L = sm.n_layers
    resid = [f"blocks.{l}.hook_resid_post" for l in range(L)]
    pattern = [f"blocks.{l}.attn.hook_pattern" for l in range(L)]
    ps = C.prompts(N)
    batches = [sm.tokenize(ps[i:i + B], chat=True) for i in range(0, N, B)]
    n_tok = sum(int(t.attention_mask.sum()) for t in batches)
    width = max(int(t.input_ids.shape[1]) for t in batches)
    print(f"model {sm.name} ({sm.hf_model.config._attn_implementation} attention) loaded in "
          f"{time.perf_counter() - t0:.1f} s; torch {torch.__version__}, {threads} thread(s); {N} prompts "
          f"({n_tok} tokens, up to {width} per row) in {len(batches)} batches of {B}", flush=True)

    def bare(tk):
        sm.forward(tk)

    def rec(names):
        def f(tk):
            with sm.record(names, positions="all") as cache:
                sm.forward(tk)
            return [cache[n] for n in names]
        return f

    conds = {"bare": bare, "resid_post": rec(resid), "pattern": rec(pattern)}
    for f in conds.values():  # warm-up on the first batch
        f(batches[0])
    times = {n: {"cpu": [], "wall": []} for n in conds}
    names = list(conds)
    kept_bytes = {"resid_post": 0, "pattern": 0}
    for i, tk in enumerate(batches):
        order = names[i % 3:] + names[:i % 3]
        for n in order:
            with Clock() as c:
                out = conds[n](tk)
            times[n]["cpu"].append(c.cpu)
            times[n]["wall"].append(c.wall)
            if out is not None:
                kept_bytes[n] += sum(x.numel() * x.element_size() for x in out)
            del out
        print(f"  batch {i + 1}/{len(batches)} {tuple(tk.input_ids.shape)}: " + ", ".join(
            f"{n} {times[n][a.clock][-1]:.2f} s" for n in names), flush=True)
    other = "wall" if a.clock == "cpu" else "cpu"
    tot = {n: sum(times[n][a.clock]) for n in names}
    tot_o = {n: sum(times[n][other]) for n in names}
    ratio = tot["resid_post"] / tot["pattern"]
    ratio_o = tot_o["resid_post"] / tot_o["pattern"]
    rows, out = [], []
    for n in names:
        rows.append([n, f"{tot[n]:.2f}", f"{tot_o[n]:.2f}", f"{N / tot[n]:.2f}", f"{tot['bare'] / tot[n]:.3f}",
                     f"{kept_bytes.get(n, 0) / 2**20:.1f}"])
        out.append({"mode": "quick" if a.quick else "full", "condition": n, "prompts": N, "batch": B, "tokens": n_tok,
                    "clock": a.clock, "total_s": round(tot[n], 3), "total_other_s": round(tot_o[n], 3),
                    "prompts_per_s": round(N / tot[n], 3), "throughput_vs_bare": round(tot["bare"] / tot[n], 4),
                    "resid_post_over_pattern": round(ratio, 4) if n == "pattern" else "",
                    "recorded_mib": round(kept_bytes.get(n, 0) / 2**20, 2)})
    print()
    print(C.table(["condition", f"total {a.clock} s", f"total {other} s", "prompts/s", "throughput vs bare",
                   "recorded MiB"], rows, title=f"{L} layers recorded, positions='all', {N} prompts"))
    print(f"throughput ratio pattern / resid_post (= resid_post time / pattern time): {ratio:.3f} ({a.clock}), "
          f"{ratio_o:.3f} ({other})")
    path = C.csv_rows(Path(a.out), [{**r, "threads": threads} for r in out])
    print(f"wrote {len(out)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
