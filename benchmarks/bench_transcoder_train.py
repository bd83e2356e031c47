"""Training a transcoder for every block of the default model: tokens per second, and the quality of the set.

Trains with :func:`steerkit.probes.train_transcoders` (all 30 blocks of the embedded SmolLM2-135M-Instruct, TopK,
k 32, expansion 8, sparsify's signum optimizer, float32, the default precision) on ``--tokens``
tokens of the vendored corpus into ``--folder``, resuming there when a checkpoint of the same run exists (run it again
after an interruption), or reads a finished folder (``--from OUT``, e.g. one trained with ``steerkit sae train
--transcoder``). Rows go to ``benchmarks/results/transcoder_train.csv``:

* ``summary``: training tokens, the seconds of sparsify's ``fit`` in the last call and the tokens it trained
  (``resumed_tokens`` were trained before an interruption), tokens per second, the wall-clock minutes of the whole
  run when it is known (``--wall-minutes``, e.g. from ``/usr/bin/time``), the replacement model's CE losses (clean,
  every MLP replaced by its transcoder, every MLP output zeroed) and the CE loss recovered, and the 1-minute load
  average when the row was written (the machine may be shared);
* ``layer``: per block the FVU of ``hook_mlp_out``, L0 and dead latents on the held-out tokens.

Usage:  python benchmarks/bench_transcoder_train.py --tokens 500000 --folder transcoders-smollm2
        python benchmarks/bench_transcoder_train.py --from transcoders-smollm2 --wall-minutes 84.5
        python benchmarks/bench_transcoder_train.py --quick --folder /tmp/tc --out /tmp/tc.csv   # 10k tokens
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def rows_of(metrics: dict, wall_minutes: float | None) -> list[dict]:
    trained = metrics["tokens"] - metrics.get("resumed_tokens", 0)
    summary = {"kind": "summary", "blocks": len(metrics["per_layer"]), "d_sae": metrics["d_sae"], "k": metrics["k"],
               "tokens": metrics["tokens"], "resumed_tokens": metrics.get("resumed_tokens", 0),
               "fit_seconds_last_call": metrics["seconds"], "tokens_last_call": trained,
               "tokens_per_second": metrics["tokens_per_second"], "wall_minutes": wall_minutes,
               "bfloat16_autocast": metrics.get("bfloat16_autocast"), "eval_tokens": metrics["eval_tokens"],
               "ce_loss_clean": round(metrics["ce_loss_clean"], 4), "ce_loss_replaced": round(metrics["ce_loss_replaced"], 4),
               "ce_loss_zero_ablation": round(metrics["ce_loss_zero_ablation"], 4),
               "ce_loss_recovered": round(metrics["ce_loss_recovered"], 4), "load_avg_1m": round(os.getloadavg()[0], 2)}
    layers = [{"kind": "layer", "layer": r["layer"], "fvu": round(r["fvu"], 4), "l0": r["l0"],
               "dead_latents": r["dead_latents"]} for r in metrics["per_layer"]]
    return [summary, *layers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=500_000)
    ap.add_argument("--folder", default="transcoders-smollm2", help="where the transcoders are trained (and resumed)")
    ap.add_argument("--from", dest="source", default=None, help="a finished folder to read instead of training")
    ap.add_argument("--wall-minutes", type=float, default=None, help="the whole run's wall-clock minutes, if known")
    ap.add_argument("--quick", action="store_true", help="10,000 tokens (a check of the mechanics, not a figure)")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "transcoder_train.csv"),
                    help="the CSV")
    args = ap.parse_args()
    if args.quick:
        args.tokens = 10_000
    if args.source is None:
        import steerkit
        from steerkit.probes import train_transcoders

        sm = steerkit.load_model(device="cpu")
        metrics = train_transcoders(sm, "all", tokens=args.tokens, out=args.folder,
                                    eval_tokens=1024 if args.quick else 8192).metrics
    else:
        metrics = json.loads((Path(args.source) / "metrics.json").read_text(encoding="utf-8"))
    rows = rows_of(metrics, args.wall_minutes)
    print(C.table(list(rows[0]), [list(rows[0].values())]))
    print(C.table(list(rows[1]), [list(r.values()) for r in rows[1:]]))
    print("wrote", C.csv_rows(Path(args.out), rows))


if __name__ == "__main__":
    main()
