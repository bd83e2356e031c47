"""BiPO vs difference of means at the same norm, on held-out A/B preference pairs (default model).

Trains a BiPO vector (``steerkit.probes.train_bipo``, Cao et al. 2024) on templated myopic-reward A/B
pairs (``steerkit.probes.myopic_items``), computes the difference-of-means (CAA) vector of the same
items at the same layer (``steerkit.probes.methods.caa.caa_vector``: block output at the answer letter, matching
minus non-matching), rescales it to the BiPO vector's norm, and scores held-out pairs: the 24
hand-written items of ``steerkit.probes.methods.caa.AB_ITEMS`` (a different distribution from the templates) and
optionally templated items disjoint from the training ones. For each condition (unsteered, BiPO +v,
diff-of-means +v, and both negated) it reports the mean preference margin
``log p(chosen) - log p(rejected)`` (completions ``"(A) <answer>"``, log-probabilities summed over the
completion tokens after the chat-formatted question) and the accuracy (margin > 0).

Usage:  python scripts/bipo_vs_diffmean.py                 # 32 training pairs, 3 epochs, layer 15
        python scripts/bipo_vs_diffmean.py --quick         # 8 training pairs, 1 epoch, 8 held-out pairs
        python scripts/bipo_vs_diffmean.py --out result.json --heldout-templated 24
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import steerkit
from steerkit import Intervention
from steerkit.probes import myopic_items, preference_margins, preference_pairs, train_bipo
from steerkit.probes.methods.caa import AB_ITEMS, caa_vector


def summary(m: torch.Tensor) -> dict:
    """Mean margin, its standard error and the accuracy (margin > 0) of a margin vector."""
    m = m.double()
    se = float(m.std() / len(m) ** 0.5) if len(m) > 1 else 0.0
    return {"mean_margin": round(float(m.mean()), 4), "se": round(se, 4),
            "accuracy": round(float((m > 0).double().mean()), 4), "n": int(len(m))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 training pairs, 1 epoch, the first 8 held-out pairs")
    ap.add_argument("--layer", type=int, default=15, help="block whose output is steered (default 15)")
    ap.add_argument("--n-train", type=int, default=None, help="templated training pairs (default 32; quick 8)")
    ap.add_argument("--epochs", type=int, default=None, help="BiPO epochs (default 3; quick 1)")
    ap.add_argument("--batch-size", type=int, default=8, help="pairs per BiPO step (default 8)")
    ap.add_argument("--lr", type=float, default=0.05, help="AdamW learning rate (default 0.05)")
    ap.add_argument("--beta", type=float, default=0.1, help="BiPO beta (default 0.1, the paper's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-templated", type=int, default=0,
                    help="also score N templated items disjoint from the training ones (default 0)")
    ap.add_argument("--no-negated", action="store_true", help="skip the -v conditions")
    ap.add_argument("--max-heldout", type=int, default=None, help="score only the first N hand-written items")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="bipo_vs_diffmean.json", help="JSON output (default ./bipo_vs_diffmean.json)")
    a = ap.parse_args(argv)
    n_train = a.n_train or (8 if a.quick else 32)
    epochs = a.epochs or (1 if a.quick else 3)
    if a.threads:
        torch.set_num_threads(a.threads)

    t0 = time.perf_counter()
    sm = steerkit.load_model()
    train_items = myopic_items(n_train, seed=a.seed, exclude=AB_ITEMS)
    held = {"handwritten": list(AB_ITEMS[:a.max_heldout or (8 if a.quick else len(AB_ITEMS))])}
    if a.heldout_templated:
        held["templated"] = myopic_items(a.heldout_templated, seed=a.seed + 1, exclude=list(AB_ITEMS) + train_items)
    train_pairs = preference_pairs(train_items)
    print(f"{sm.name}: layer {a.layer}, {n_train} training pairs, {epochs} epoch(s), batch {a.batch_size}, "
          f"lr {a.lr}, beta {a.beta}; held-out {', '.join(f'{k} {len(v)}' for k, v in held.items())}",
          file=sys.stderr, flush=True)

    t1 = time.perf_counter()
    r = train_bipo(sm, train_pairs, a.layer, epochs=epochs, lr=a.lr, beta=a.beta, batch_size=a.batch_size,
                   seed=a.seed)
    train_s = time.perf_counter() - t1
    v_bipo = r.tensor.float()
    dm_raw = caa_vector(sm, train_items, batch_size=a.batch_size)[a.layer].float()
    norm = float(v_bipo.norm())
    v_dm = dm_raw * (norm / float(dm_raw.norm()))
    cos = float(torch.nn.functional.cosine_similarity(v_bipo, v_dm, dim=0))
    site = f"blocks.{a.layer}.hook_resid_post"
    conds = {"unsteered": None, "bipo": v_bipo, "diffmean": v_dm}
    if not a.no_negated:
        conds.update({"bipo_negated": -v_bipo, "diffmean_negated": -v_dm})

    results: dict = {}
    margins: dict = {}
    with tqdm(total=len(held) * len(conds), desc="eval", file=sys.stderr) as bar:
        for split, items in held.items():
            pairs = preference_pairs(items)
            results[split] = {}
            for name, vec in conds.items():
                steering = None if vec is None else Intervention.add(site, vec)
                m = preference_margins(sm, pairs, steering=steering, batch_size=a.batch_size)
                margins.setdefault(split, {})[name] = m
                results[split][name] = {**summary(m), "margins": [round(float(x), 4) for x in m]}
                bar.update(1)
            # paired per item: how far each steering moves the margin from the unsteered one, and
            # BiPO against difference of means on the same items
            ms = margins[split]
            paired = {f"{name} - unsteered": ms[name] - ms["unsteered"] for name in ms if name != "unsteered"}
            paired["bipo - diffmean"] = ms["bipo"] - ms["diffmean"]
            if "bipo_negated" in ms:
                paired["diffmean_negated - bipo_negated"] = ms["diffmean_negated"] - ms["bipo_negated"]
            results[split]["paired"] = {k: summary(v) for k, v in paired.items()}
    out = {
        "model": sm.name, "layer": a.layer, "site": "resid_post", "mode": "quick" if a.quick else "full",
        "n_train": n_train, "epochs": epochs, "batch_size": a.batch_size, "lr": a.lr, "beta": a.beta, "seed": a.seed,
        "norm": round(norm, 4), "diffmean_raw_norm": round(float(dm_raw.norm()), 4), "cosine_bipo_diffmean": round(cos, 4),
        "bipo_epoch_losses": [round(x, 5) for x in r.epoch_losses()], "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t0, 1), "heldout": results,
        "bipo": r.to_json(),
    }
    for split, rows in results.items():
        print(f"\nheld-out {split} ({rows['unsteered']['n']} pairs), |v| = {norm:.3f}, cos(bipo, diffmean) = {cos:.3f}")
        print(f"{'condition':<18} {'mean margin':>12} {'se':>8} {'accuracy':>9}")
        for name, s in rows.items():
            if name != "paired":
                print(f"{name:<18} {s['mean_margin']:>12.4f} {s['se']:>8.4f} {s['accuracy']:>9.3f}")
        print("paired per item (difference of margins)")
        for name, s in rows["paired"].items():
            print(f"  {name:<32} {s['mean_margin']:>+9.4f} se {s['se']:.4f} (> 0 on {s['accuracy']:.3f} of items)")
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {a.out} ({out['total_seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
