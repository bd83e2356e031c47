"""What batching buys on this machine: cost per row of a per-row steered generation and of a scoring
forward pass, against the number of rows per call.

``probes.tune`` and the refusal candidate search (``select_direction``) gain their speed by putting
many grid cells / candidates into one call as per-row steering. That pays only where a call of ``B``
rows costs less than ``B`` times a call of one row, i.e. where the device is not already busy at the
batch the one-cell-at-a-time path uses (32 rows for ``tune``'s per-cell path, 16 prompts for the
refusal search). This script measures the cost per row at each ``--sizes`` batch, in one run:

* ``generate``: ``sm.generate`` of ``B`` chat prompts (``_common.prompts``) for ``--tokens`` greedy
  tokens, every row steered by its own addition at block ``--layer`` (``B`` distinct strengths of the
  benchmarks' norm-4 vector), as in a batched tune;
* ``score``: one forward pass over the same ``B`` prompts with each row's own ablation of a unit
  direction at every block input, attention output and MLP output, and the logits of the last
  position only (``refusal.last_logits``), as in a batched refusal search.

Repeats are interleaved (each round runs every size). Columns: ``ms_per_row`` (median over rounds),
``rows_per_s`` and ``gain_vs_ref`` = the cost per row at the reference batch (``--ref-generate``,
``--ref-score``) over the cost per row at this batch: the most that regrouping the reference path's
rows into calls of ``B`` rows can save, before any other change. Rows go to
``benchmarks/results/batch_scaling.csv``.

Usage:  python benchmarks/bench_batch_scaling.py                # sizes 1 .. 256, 16 tokens, 3 rounds
        python benchmarks/bench_batch_scaling.py --quick        # sizes 1, 4, 16; 4 tokens; 1 round
        python benchmarks/bench_batch_scaling.py --device cuda --clock wall
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes 1, 4, 16; 4 tokens; 1 round")
    ap.add_argument("--sizes", default=None, help="comma-separated rows per call (default 1,4,8,16,32,64,128,256)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (default 16; quick 4)")
    ap.add_argument("--layer", type=int, default=12, help="block of the added vector (default 12)")
    ap.add_argument("--ref-generate", type=int, default=32, help="reference batch of `generate` (default 32: "
                    "tune's per-cell path on 32 prompts)")
    ap.add_argument("--ref-score", type=int, default=16, help="reference batch of `score` (default 16: the "
                    "refusal search's one-at-a-time path on 16 validation prompts)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--device", default="cpu", help="torch device of the model (default cpu; on cuda read the wall "
                    "times)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "batch_scaling.csv"))
    a = ap.parse_args(argv)

    import torch

    import steerkit
    from steerkit import Intervention
    from steerkit.probes.methods import refusal as R

    threads = C.set_threads(a.threads)
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([1, 4, 16] if a.quick else
                                                                   [1, 4, 8, 16, 32, 64, 128, 256])
    tokens = a.tokens or (4 if a.quick else 16)
    repeats = a.repeats or (1 if a.quick else 3)
    sm = steerkit.load_model(device=a.device)
    v, u = C.steering_vectors(sm.d_model)
    prompts = C.prompts(max(sizes))
    add_site = f"blocks.{a.layer}.hook_resid_pre"
    # every block's input, attention and MLP output (3 sites a block; the refusal search's ablation now acts at
    # the 2L+1 sites of the DirectionSet it saves, R.ablation_artifact): the workload of the recorded numbers
    ablate_sites = [f"blocks.{l}.{k}" for l in range(sm.n_layers) for k in ("hook_resid_pre", "hook_attn_out",
                                                                          "hook_mlp_out")]
    print(f"model {sm.name} on {a.device}; torch {torch.__version__}, {threads} thread(s); sizes {sizes}; "
          f"{tokens} tokens; {repeats} round(s)", flush=True)

    def generate(b: int):
        steer = [[Intervention.add(add_site, v, 0.5 + 3.5 * i / max(1, b - 1))] for i in range(b)]
        return sm.generate(prompts[:b], max_new_tokens=tokens, steer_rows=steer, return_tokens=True, chat=True)

    def score(b: int):
        steer = [[Intervention.ablate(s, u, 0.5 + 0.5 * i / max(1, b - 1)) for s in ablate_sites] for i in range(b)]
        with sm.steer(rows=steer, label="batch scaling"):
            return R.last_logits(sm, prompts[:b], batch_size=b)

    kinds = {"generate": generate, "score": score}
    refs = {"generate": a.ref_generate, "score": a.ref_score}
    generate(2), score(2)  # warm-up
    times: dict = {(k, b): {"cpu": [], "wall": []} for k in kinds for b in sizes}
    for r in range(repeats):
        for k, fn in kinds.items():
            for b in sizes:
                with C.Clock() as c:
                    fn(b)
                times[(k, b)]["cpu"].append(c.cpu)
                times[(k, b)]["wall"].append(c.wall)
            print(f"  round {r + 1}/{repeats} {k}: " + ", ".join(
                f"{b}: {times[(k, b)][a.clock][-1]:.2f} s" for b in sizes), flush=True)
    other = "wall" if a.clock == "cpu" else "cpu"
    per_row = {key: C.median(t[a.clock]) / key[1] for key, t in times.items()}
    out, rows = [], []
    for k in kinds:
        ref = refs[k]
        base = per_row.get((k, ref))
        for b in sizes:
            ms = 1000 * per_row[(k, b)]
            gain = None if base is None else base / per_row[(k, b)]
            rows.append([k, b, f"{ms:.1f}", f"{1000 / ms:.2f}", "" if gain is None else f"{gain:.2f}"])
            out.append({"mode": "quick" if a.quick else "full", "device": a.device, "kind": k, "rows": b,
                        "tokens": tokens if k == "generate" else 0, "layer": a.layer, "repeats": repeats,
                        "clock": a.clock, "threads": threads, "ms_per_row": round(ms, 3),
                        "ms_per_row_other": round(1000 * C.median(times[(k, b)][other]) / b, 3),
                        "rows_per_s": round(1000 / ms, 3), "ref_rows": ref,
                        "gain_vs_ref": "" if gain is None else round(gain, 3)})
    print()
    print(C.table(["kind", "rows per call", f"{a.clock} ms / row", "rows / s", "gain vs reference batch"], rows,
                  title=f"cost per row against rows per call ({a.device}, {threads} thread(s); reference batch: "
                        f"generate {refs['generate']}, score {refs['score']})"))
    for k in kinds:
        gains = [o["gain_vs_ref"] for o in out if o["kind"] == k and o["gain_vs_ref"] != ""]
        if gains:
            print(f"{k}: the best batch is {max(gains):.2f}x cheaper per row than the reference batch {refs[k]}")
    path = C.csv_rows(Path(a.out), out)
    print(f"wrote {len(out)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
