"""What bfloat16 costs against float32 on this CPU, for the default model: decoding and recording, side by side.

The default model (SmolLM2-135M-Instruct) is loaded twice, ``dtype="float32"`` and ``dtype="bfloat16"``, and
each round (``--repeats``, the order of the two rotated every round) times, on both:

* ``decode``: greedy generation of ``--tokens`` new tokens (32) for ``--batch`` chat prompts (8), unsteered;
* ``decode steered``: the same with ``sm.edit("blocks.15.hook_resid_post", add=v)`` (the benchmarks' fixed
  norm-4 vector), through the fused steering kernel's torch path;
* ``record``: ``hook_resid_post`` of all 30 layers at the last position for ``--prompts`` prompts (64) in batches
  of 16, copied to the CPU (``sm.record(..., device="cpu")``).

Times are the process's CPU time (one torch thread by default, so the figure is what the work cost whatever
else the machine did) per decoding step or per prompt; the ratio is bfloat16 over float32 of the median over
rounds. Rows go to ``benchmarks/results/dtype.csv``.

Usage:  python benchmarks/bench_dtype.py            # 3 rounds
        python benchmarks/bench_dtype.py --quick    # 1 round, 8 tokens, 16 prompts
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LAYER = 15
DTYPES = ("float32", "bfloat16")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 8 tokens, 16 prompts")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (3; quick 1)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (32; quick 8)")
    ap.add_argument("--batch", type=int, default=8, help="prompts per generation (8)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts recorded (64; quick 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "dtype.csv"))
    a = ap.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 3)
    tokens = a.tokens or (8 if a.quick else 32)
    n_rec = a.prompts or (16 if a.quick else 64)

    import steerkit

    threads = C.set_threads(a.threads)
    models = {dt: steerkit.load_model(dtype=dt, device="cpu") for dt in DTYPES}
    sm0 = models["float32"]
    v, _ = C.steering_vectors(sm0.d_model)
    gen_ids = sm0.pad([sm0.tokenize(p, chat=True).input_ids[0].tolist() for p in C.prompts(a.batch)])
    rec_prompts = C.prompts(n_rec)
    sites = steerkit.resid_post(range(sm0.n_layers))

    def decode(sm, steered: bool) -> tuple[float, int]:
        scope = sm.edit(f"blocks.{LAYER}.hook_resid_post", add=v) if steered else None
        with C.Clock() as clk:
            if scope is None:
                out = sm.generate(gen_ids, max_new_tokens=tokens, return_tokens=True)
            else:
                with scope:
                    out = sm.generate(gen_ids, max_new_tokens=tokens, return_tokens=True)
        return clk.cpu, max(len(o) for o in out)

    def record(sm) -> tuple[float, int]:
        with C.Clock() as clk:
            for i in range(0, len(rec_prompts), 16):
                with sm.record(sites, positions="last", device="cpu") as cache:
                    sm.forward(rec_prompts[i:i + 16], chat=True)
                cache.stack()
        return clk.cpu, len(rec_prompts)

    work = {"decode": lambda sm: decode(sm, False), "decode steered": lambda sm: decode(sm, True), "record": record}
    for sm in models.values():  # warm-up
        decode(sm, True)
        record(sm)
    per: dict = {(w, dt): [] for w in work for dt in DTYPES}
    for r in range(repeats):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        for w, fn in work.items():
            for dt in order:
                cpu, n = fn(models[dt])
                per[(w, dt)].append(1000 * cpu / max(n, 1))
        print(f"round {r + 1}/{repeats} done", flush=True)
    rows, shown = [], []
    for w in work:
        f32, bf = C.median(per[(w, "float32")]), C.median(per[(w, "bfloat16")])
        unit = "ms per prompt" if w == "record" else "ms per step"
        for dt, m in (("float32", f32), ("bfloat16", bf)):
            rows.append({"mode": "quick" if a.quick else "full", "work": w, "dtype": dt, "cpu_ms": round(m, 2),
                         "unit": unit, "bf16_over_f32": round(bf / f32, 3), "tokens": tokens, "batch": a.batch,
                         "prompts": n_rec, "repeats": repeats, "threads": threads})
        shown.append([w, unit, f"{f32:.1f}", f"{bf:.1f}", f"{bf / f32:.2f}"])
    print(C.table(["work", "unit", "float32 CPU ms", "bfloat16 CPU ms", "bfloat16 / float32"], shown,
                  title=f"bfloat16 vs float32 on the default model ({threads} thread(s), median of {repeats})"))
    print(f"wrote {len(rows)} rows to {C.csv_rows(Path(a.out), rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
