"""Steered greedy decoding with an SAE latent: a clamp (a torch step) vs a plain add of its decoder row (the fused
kernel) vs unsteered, on the default model.

The SAE: the trained TopK SAE at ``--sae`` (by default ``/work/sae-runs/sae-smollm2-l12/layers.12`` when that folder
exists; otherwise a random TopK SAE at ``blocks.12.hook_resid_post``, d_sae 9216, k 32, seed 0). The latent
(``--latent``; by default the one with the largest mean activation over the prompts' tokens after each row's first,
whose residual is orders of magnitude larger) and the value ``v`` (``--value``; by default twice the latent's largest
activation on those tokens). Conditions, each ``sm.generate`` of the same ``--prompts`` chat prompts, greedy,
``--tokens`` new tokens, every position steered:

  unsteered     no steering
  add           ``Intervention.sae_latent(site, sae, [i], scale=v, mode="add")``: ``h + v * W_dec[i]``, a plain add
                (the fused kernel)
  clamp-topk    ``Intervention.sae_latent(site, sae, [i], value=v)``: the latent set to ``v`` with the error term
                kept, ``h + (v - f_i(h)) * W_dec[i]``; a TopK SAE reads its whole encoder to know whether ``i`` is
                among the ``k`` (a torch step of the site's program)
  clamp-relu    the same clamp with the SAE's weights read as a ReLU SAE (``SAEWeights(..., architecture="relu")``),
                whose clamp reads only latent ``i``'s encoder column (the SAE restricted to the latent)

After one warm-up of each, ``--repeats`` rounds run every condition once in an order rotated each round; times are
this single-threaded process's CPU seconds (``--clock``) per decoding step (a run's time over its longest row's new
tokens: rows may stop at EOS at different steps). ``tokens_per_s`` counts every row at every step (batch x steps /
time); the ratios compare the medians. ``rows_changed`` is how many rows' tokens differ from the unsteered ones.

Usage:  python benchmarks/bench_sae_steer.py              # 8 prompts x 32 new tokens, 5 repeats
        python benchmarks/bench_sae_steer.py --quick      # 2 prompts x 8 new tokens, 1 repeat

Rows go to ``benchmarks/results/sae_steer.csv`` (``--out``): one per condition.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TRAINED = Path("/work/sae-runs/sae-smollm2-l12/layers.12")
PROMPTS = ["Tell me about your weekend.", "Describe the city you live in.", "Write about Mondays.",
           "What is a good breakfast?", "Explain rain to a child.", "Name a famous painter.",
           "How do birds fly?", "Give me a tip for learning."]
CONDS = ("unsteered", "add", "clamp-topk", "clamp-relu")


def pick_latent(sm, sae, prompts: list[str]) -> tuple[int, float]:
    """The latent with the largest mean activation over the prompts' tokens (chat template) after each row's first
    one (whose residual is orders of magnitude larger than the others'), and its largest activation there."""
    acts = f"{sae.site}.hook_sae_acts_post"
    with sm.attach_sae(sae), sm.record(acts) as cache:
        toks = sm.tokenize(prompts, chat=True)
        sm.forward(toks)
    mask = toks.attention_mask.bool()
    first = mask.long().argmax(-1)  # left padding: each row's first real position
    mask[torch.arange(mask.shape[0]), first] = False
    f = cache[acts][mask]  # [n, d_sae]
    i = int(f.mean(0).argmax())
    return i, float(f[:, i].max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts x 8 new tokens, 1 repeat")
    ap.add_argument("--prompts", type=int, default=None, help=f"rows in the batch (8, at most {len(PROMPTS)}; quick 2)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (32; quick 8)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved timed rounds (5; quick 1)")
    ap.add_argument("--layer", type=int, default=12, help="block of the random SAE (blocks.L.hook_resid_post)")
    ap.add_argument("--sae", default=None, help=f"an SAE folder or file for steerkit.load_sae (default {TRAINED} when "
                    "it exists, else a random TopK SAE, d_sae 9216, k 32); 'random' forces the random one")
    ap.add_argument("--latent", type=int, default=None, help="the latent to steer (default: the largest mean activation "
                    "over the prompts' tokens after the first)")
    ap.add_argument("--value", type=float, default=None, help="the clamp value and the add's scale (default: twice the "
                    "latent's largest activation over the prompts)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="time the figures use (default cpu: the process's CPU time); the other is printed too")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "sae_steer.csv"))
    a = ap.parse_args(argv)
    n_prompts = min(a.prompts or (2 if a.quick else 8), len(PROMPTS))
    tokens = a.tokens or (8 if a.quick else 32)
    repeats = a.repeats or (1 if a.quick else 5)

    def log(s: str) -> None:
        print(s, flush=True)

    import steerkit
    from steerkit.sae import SAEWeights
    from bench_sae_record import random_topk_sae

    threads = C.set_threads(a.threads)
    sm = steerkit.load_model()
    path = Path(a.sae) if a.sae and a.sae != "random" else (TRAINED if a.sae is None and TRAINED.exists() else None)
    sae = steerkit.load_sae(path, model=sm) if path is not None else random_topk_sae(sm, f"blocks.{a.layer}.hook_resid_post")
    w, site = sae.weights, sae.site
    prompts = PROMPTS[:n_prompts]
    latent, top = pick_latent(sm, sae, prompts)
    latent = latent if a.latent is None else a.latent
    value = a.value if a.value is not None else max(1.0, 2 * top)
    relu = SAEWeights(w.W_enc, w.b_enc, w.W_dec, w.b_dec, architecture="relu",
                      apply_b_dec_to_input=w.apply_b_dec_to_input)
    Iv = steerkit.Intervention
    steering = {"unsteered": None,
                "add": Iv.sae_latent(site, sae, [latent], scale=value, mode="add"),
                "clamp-topk": Iv.sae_latent(site, sae, [latent], value=value),
                "clamp-relu": Iv.sae_latent(site, relu, [latent], value=value)}
    log(f"model {sm.name}; SAE {path or 'random'}: {w.architecture} at {site}, d_sae {w.d_sae}, k {w.k}; latent {latent} "
        f"(largest activation on the prompts {top:.3g}), value {value:.3g}; {n_prompts} prompts x {tokens} new tokens; "
        f"{threads} torch thread(s); clock {a.clock}")

    def run(cond: str) -> tuple[C.Clock, int, list]:
        with C.Clock() as clk:
            out = sm.generate(prompts, max_new_tokens=tokens, chat=True, return_tokens=True, steering=steering[cond])
        return clk, max(1, max(len(o) for o in out)), out

    res = {c: {"wall": [], "cpu": [], "steps": []} for c in CONDS}
    outs: dict = {}
    for c in CONDS:  # warm-up
        outs[c] = run(c)[2]
    for r in range(repeats):
        for c in CONDS[r % len(CONDS):] + CONDS[:r % len(CONDS)]:
            clk, steps, outs[c] = run(c)
            res[c]["wall"].append(clk.wall / steps)
            res[c]["cpu"].append(clk.cpu / steps)
            res[c]["steps"].append(steps)
        log(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{c} {1e3 * res[c]['cpu'][-1]:.1f}" for c in CONDS)
            + " (CPU ms per step)")
    other = "wall" if a.clock == "cpu" else "cpu"
    med = {c: statistics.median(res[c][a.clock]) for c in CONDS}
    med_o = {c: statistics.median(res[c][other]) for c in CONDS}
    base = {"mode": "quick" if a.quick else "full", "sae": "trained" if path is not None else "random",
            "architecture": w.architecture, "site": site, "d_sae": w.d_sae, "k": w.k, "latent": latent,
            "value": round(value, 4), "prompts": n_prompts, "new_tokens": tokens, "repeats": repeats, "threads": threads}
    rows = []
    for c in CONDS:
        rows.append({**base, "condition": c, "ms_per_step": round(1e3 * med[c], 3),
                     "ms_per_step_other_clock": round(1e3 * med_o[c], 3),
                     "tokens_per_s": round(n_prompts / med[c], 1),
                     "steps": int(statistics.median(res[c]["steps"])),
                     "overhead_vs_unsteered_pct": round(100 * (med[c] / med["unsteered"] - 1), 2),
                     "overhead_vs_unsteered_other_clock_pct": round(100 * (med_o[c] / med_o["unsteered"] - 1), 2),
                     "time_over_add": round(med[c] / med["add"], 3),
                     "rows_changed": sum(o != u for o, u in zip(outs[c], outs["unsteered"]))})
    log(C.table(["condition", f"ms/step ({a.clock})", "tokens/s", "steps", "overhead vs unsteered",
                 f"overhead ({other})", "time / add", "rows changed"],
                [[r["condition"], r["ms_per_step"], r["tokens_per_s"], r["steps"],
                  f"{r['overhead_vs_unsteered_pct']:+.1f}%", f"{r['overhead_vs_unsteered_other_clock_pct']:+.1f}%",
                  r["time_over_add"], f"{r['rows_changed']}/{n_prompts}"] for r in rows],
                title=f"steered decoding, batch {n_prompts} ({a.clock} clock)"))
    log(f"wrote {C.csv_rows(Path(a.out), rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
