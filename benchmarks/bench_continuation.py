"""Scoring given continuations: ``continuation_logprobs`` (each prompt's KV cache computed once, rows feed
only their continuation) vs one full forward of prompt + continuation per row (log-softmax of the logits).

``--rows`` rows (default 160: five continuations of each of 32 prompts, as ``tune`` scores a baseline and
four cells) of ``--tokens`` random token ids (default 32) after the benchmarks' chat prompts
(``_common.prompts``, ~37-49 tokens with the template). Conditions, timed as whole calls in rotated order
over ``--repeats`` rounds:

* ``cached``: ``steerkit.continuation_logprobs(sm, prompt_ids, rows, batch_size=--batch)``;
* ``full``: ``sm.forward`` of prompt + continuation in batches of ``--batch`` rows at most (fewer when the
  logits would pass 2^27 floats, as ``tune`` did before), then the log-softmax at the continuation.

Both must agree (the largest |difference| of any log-probability is printed and written). Rows go to
``benchmarks/results/continuation.csv`` with ``time_over_cached``.

Usage:  python benchmarks/bench_continuation.py               # 160 rows x 32 tokens, 3 rounds
        python benchmarks/bench_continuation.py --quick       # 10 rows x 8 tokens, 1 round
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 rows x 8 tokens, 1 round")
    ap.add_argument("--rows", type=int, default=None, help="rows (default 160; quick 10)")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts (default 32)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per continuation (default 32; quick 8)")
    ap.add_argument("--batch", type=int, default=64, help="rows per pass (default 64)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--device", default="cpu", help="torch device of the model (default cpu)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "continuation.csv"))
    a = ap.parse_args(argv)

    import torch

    import steerkit

    threads = C.set_threads(a.threads)
    n_rows = a.rows or (10 if a.quick else 160)
    tokens = a.tokens or (8 if a.quick else 32)
    repeats = a.repeats or (1 if a.quick else 3)
    sm = steerkit.load_model(device=a.device)
    toks = sm.tokenize(C.prompts(a.prompts), chat=True)
    ids = [toks.input_ids[b][toks.attention_mask[b].bool()].tolist() for b in range(len(toks))]
    g = torch.Generator().manual_seed(0)
    rows = [(i % len(ids), torch.randint(100, 20000, (tokens,), generator=g).tolist()) for i in range(n_rows)]
    vocab = int(sm.forward(sm.pad(ids[:1]), logits_to_keep=1).shape[-1])
    print(f"model {sm.name}; {threads} thread(s); {n_rows} rows x {tokens} tokens after {len(ids)} prompts "
          f"({min(map(len, ids))}-{max(map(len, ids))} tokens); batch {a.batch}", flush=True)

    def cached():
        return steerkit.continuation_logprobs(sm, ids, rows, batch_size=a.batch)

    def full():
        out = []
        size = max(1, min(a.batch, (1 << 27) // ((max(map(len, ids)) + tokens) * vocab)))
        for i in range(0, n_rows, size):
            part = rows[i:i + size]
            batch = sm.pad([ids[p] + t for p, t in part])
            logits = sm.forward(batch)
            P = batch.input_ids.shape[1]
            for j, (_, t) in enumerate(part):
                lp = torch.log_softmax(logits[j, P - len(t) - 1:P - 1].float(), -1)
                out.append(lp.gather(-1, torch.tensor(t)[:, None])[:, 0].cpu())
        return out

    conds = {"cached": cached, "full": full}
    times = {n: {"cpu": [], "wall": []} for n in conds}
    got: dict = {}
    names = list(conds)
    for r in range(repeats):
        for name in names[r % 2:] + names[:r % 2]:
            with C.Clock() as c:
                got[name] = conds[name]()
            times[name]["cpu"].append(c.cpu)
            times[name]["wall"].append(c.wall)
            print(f"  round {r + 1}/{repeats} {name}: cpu {c.cpu:.2f} s, wall {c.wall:.2f} s", flush=True)
    diff = max(float((x - y).abs().max()) for x, y in zip(got["cached"], got["full"]))
    other = "wall" if a.clock == "cpu" else "cpu"
    base = C.median(times["cached"][a.clock])
    out, table = [], []
    for name in names:
        med = C.median(times[name][a.clock])
        table.append([name, f"{med:.2f}", f"{C.median(times[name][other]):.2f}", f"{med / base:.2f}"])
        out.append({"mode": "quick" if a.quick else "full", "device": a.device, "condition": name, "rows": n_rows,
                    "tokens": tokens, "prompts": len(ids), "batch": a.batch, "repeats": repeats, "clock": a.clock,
                    "threads": threads, "median_s": round(med, 3),
                    "median_other_s": round(C.median(times[name][other]), 3),
                    "time_over_cached": round(med / base, 3), "max_abs_diff": f"{diff:.3g}"})
    print()
    print(C.table(["condition", f"median {a.clock} s", f"median {other} s", "time / cached"], table,
                  title=f"scoring {n_rows} continuations of {tokens} tokens; max |logprob diff| {diff:.2g}"))
    print(f"wrote {len(out)} rows to {C.csv_rows(Path(a.out), out)}")
    return 0 if diff < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
