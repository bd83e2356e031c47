"""Training an SAE with sparsify on the default model: training tokens per second, and the forward pass up to the
SAE's layer against the full one.

Two measurements on the embedded SmolLM2-135M-Instruct, at block ``--layer``'s output:

* ``forward``: one batch of ``--batch-size`` rows of ``--ctx-len`` corpus tokens through the base model run only up
  to the layer (what :func:`steerkit.probes.train_sae` runs: ``truncated``) and through the whole model with its LM
  head (``sm.hf_model(ids)``), under ``torch.no_grad``; the median of ``--repeats`` passes after a warm-up, as
  tokens per second, and their ratio.
* ``train``: :func:`steerkit.probes.train_sae` on ``--tokens`` tokens of the vendored corpus (k 32, expansion 16,
  sparsify's signum optimizer), its training tokens per second (sparsify's ``fit`` alone), the time of the corpus
  tokenization and of the held-out metrics, the metrics, and the minutes 2,000,000 tokens would take at that rate
  (training, plus the same tokenization and metrics).

The 1-minute load average of the machine before each measurement is in the rows (the machine may be shared).
Rows go to ``benchmarks/results/sae_train.csv``.

Usage:  python benchmarks/bench_sae_train.py                 # 100k training tokens at layer 12
        python benchmarks/bench_sae_train.py --quick         # 10k tokens, 2 forward repeats
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

FULL_RUN = 2_000_000


def _forward_rates(sm, layer: int, ids, repeats: int) -> dict:
    import torch

    from steerkit.probes.sae_train import truncated

    def rate(fn) -> float:
        with torch.no_grad():
            fn()  # warm-up
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return ids.numel() / statistics.median(times)

    load = os.getloadavg()[0]
    with truncated(sm, layer) as (base, _):
        up_to = rate(lambda: base(ids))
    full = rate(lambda: sm.hf_model(ids))
    return {"kind": "forward", "load_avg_1m": round(load, 2), "tokens": ids.numel(),
            "up_to_layer_tok_s": round(up_to, 1), "full_with_head_tok_s": round(full, 1),
            "full_over_up_to_time_ratio": round(up_to / full, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k training tokens, 2 forward repeats")
    ap.add_argument("--tokens", type=int, default=None, help="training tokens (default 100,000; quick 10,000)")
    ap.add_argument("--layer", type=int, default=12)
    ap.add_argument("--ctx-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=None, help="forward passes timed (default 5; quick 2)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "sae_train.csv"))
    a = ap.parse_args(argv)
    tokens = a.tokens or (10_000 if a.quick else 100_000)
    repeats = a.repeats or (2 if a.quick else 5)

    import steerkit
    from steerkit.probes import read_corpus, token_chunks, train_sae

    sm = steerkit.load_model(device="cpu")
    hook = f"blocks.{a.layer}.hook_resid_post"
    print(f"model {sm.name}; {os.cpu_count()} CPUs; {hook}; ctx {a.ctx_len} x batch {a.batch_size}", flush=True)
    rows_ids = token_chunks(sm.tokenizer, read_corpus(), a.ctx_len, a.batch_size * a.ctx_len, progress=False).ids
    fwd = _forward_rates(sm, a.layer, rows_ids[: a.batch_size], repeats)
    print(C.table(["tokens", "up to layer tok/s", "full + LM head tok/s", "ratio"],
                  [[fwd["tokens"], fwd["up_to_layer_tok_s"], fwd["full_with_head_tok_s"],
                    fwd["full_over_up_to_time_ratio"]]], title="forward pass"), flush=True)

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, C.Clock() as clock:
        r = train_sae(sm, hook, tokens=tokens, ctx_len=a.ctx_len, batch_size=a.batch_size,
                      eval_tokens=a.eval_tokens, out=Path(tmp) / "sae", progress=True)
    m = r.metrics
    overhead = clock.wall - r.seconds  # corpus tokenization, sparsify's setup, the held-out metrics
    full_min = (FULL_RUN / m["tokens_per_second"] + overhead) / 60
    train = {"kind": "train", "mode": "quick" if a.quick else "full", "load_avg_1m": round(load, 2),
             "layer": a.layer, "ctx_len": a.ctx_len, "batch_size": a.batch_size, "tokens": r.tokens,
             "train_s": round(r.seconds, 1), "train_tok_s": m["tokens_per_second"], "wall_s": round(clock.wall, 1),
             "other_s": round(overhead, 1), "minutes_for_2m_tokens": round(full_min, 1), "k": m["k"],
             "d_sae": m["d_sae"], "lr": m["lr"], "l0": round(m["l0"], 2),
             "explained_variance": round(m["explained_variance"], 4), "dead_latents": m["dead_latents"],
             "dead_window_tokens": m["dead_window_tokens"], "ce_loss_clean": round(m["ce_loss_clean"], 4),
             "ce_loss_spliced": round(m["ce_loss_spliced"], 4),
             "ce_loss_zero_ablation": round(m["ce_loss_zero_ablation"], 4),
             "ce_loss_recovered": round(m["ce_loss_recovered"], 4), "eval_tokens": m["eval_tokens"]}
    print(C.table(["tokens", "train s", "train tok/s", "other s", "min for 2M", "L0", "EV", "dead", "CE recovered"],
                  [[r.tokens, train["train_s"], train["train_tok_s"], train["other_s"], train["minutes_for_2m_tokens"],
                    train["l0"], train["explained_variance"], train["dead_latents"], train["ce_loss_recovered"]]],
                  title="train_sae"))
    print(f"wrote {C.csv_rows(Path(a.out), [fwd, train])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
