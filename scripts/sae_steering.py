"""Steering with an SAE latent vs the difference of means, on held-out prompts (default model).

Finds the latent of a trained SAE (``steerkit sae train``; ``--sae`` its folder) that separates the demo's
joyful statements from its gloomy ones (``steerkit.demo.POSITIVE`` / ``NEGATIVE``): per statement, each
latent's mean activation over the statement's tokens (raw text), and the latent with the largest gap between
the two means among those active on at least half of the joyful statements (each statement's first token, the
attention sink, left out). It prints the latent's report
(``steerkit.probes.feature_report`` over joyful, gloomy and corpus texts), then steers 16 held-out neutral
prompts (none in the training sets) at the SAE's site four ways:

* ``clamp``: the latent clamped to ``c`` times its largest activation on the joyful statements, at every
  position but the first (the attention sink, whose outsized activation the SAE was trained without), the
  error term kept (``Intervention.sae_latent``, mode clamp);
* ``add``: the latent's decoder row, scaled to norm ``s``, added at the same positions (mode add);
* ``diffmean``: the demo's difference-of-means direction at the same site (last token, chat template),
  scaled to the same norm ``s``;
* unsteered.

Measured per condition: the mean joyful-minus-gloomy log-odds of the first answer token (logsumexp of the
log-probabilities of the first tokens of a joyful word list minus that of a gloomy one, at the last prompt
token; teacher-forced, no sampling), the lexicon score of 40 greedy tokens (joyful words minus gloomy words
per answer, from the same lists) and the answers' mean negative log-likelihood under the unsteered model
(higher: less fluent). Also attribution patching over the SAE's latents on an IOI pair, checked against
activation patching of the top 20 latents (Pearson r, whether the top latent by attribution is among the
top 3 by patching).

Usage:  python scripts/sae_steering.py --sae steerkit-sae/layers.12 --out sae-steering.json
        python scripts/sae_steering.py --sae ... --quick      # 4 prompts, one strength each, 16 tokens
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import steerkit
from steerkit import AnyOf, Intervention
from steerkit.demo import NEGATIVE, POSITIVE
from steerkit.probes import feature_report, latent_attribution, logit_diff_metric, read_corpus

HELD_OUT = [
    "Tell me about your weekend.", "Describe the city you live in.", "Write one sentence about Mondays.",
    "What did you have for breakfast?", "Describe a walk in the park.", "Tell me about your job.",
    "How was the weather yesterday?", "Write two sentences about trains.", "Describe your neighbour's dog.",
    "What do you think of winter?", "Tell me about a book you read.", "Describe an old house.",
    "Write a short note to a colleague.", "What happened at the meeting?", "Describe the view from a window.",
    "Tell me about your last holiday.",
]
JOYFUL = ["happy", "joy", "joyful", "wonderful", "great", "love", "lovely", "delight", "delightful", "amazing",
          "beautiful", "glad", "excited", "fantastic", "cheerful", "bright", "fun", "smile", "laugh", "perfect"]
GLOOMY = ["sad", "gloomy", "terrible", "awful", "miserable", "hate", "grey", "gray", "dreadful", "depressing",
          "lonely", "worst", "anxious", "hopeless", "tired", "boring", "bad", "cold", "dark", "disaster"]
IOI = ("When Mary and John went to the store, John gave a drink to",
       "When Mary and John went to the store, Mary gave a drink to")


def first_tokens(sm, words: list[str]) -> list[int]:
    """The first token of each word as it starts an answer, with and without a leading space and capital."""
    ids = set()
    for w in words:
        for form in (w, " " + w, w.capitalize(), " " + w.capitalize()):
            ids.add(sm.tokenizer.encode(form, add_special_tokens=False)[0])
    return sorted(ids)


def find_latent(sm, sae) -> dict:
    """The latent with the largest joyful-minus-gloomy gap of per-statement mean activations."""
    means = []
    for texts in (POSITIVE, NEGATIVE):
        rows = []
        for t in texts:
            with sm.record(sae.site) as cache:
                sm.forward([t], chat=False)
            rows.append(sae.encode(cache[sae.site][0, 1:].float()).mean(0))  # the first token: the attention sink
        means.append(torch.stack(rows))  # [n, d_sae]
    pos, neg = means
    gap = pos.mean(0) - neg.mean(0)
    eligible = (pos > 0).float().mean(0) >= 0.5
    gap_e = torch.where(eligible, gap, torch.full_like(gap, -float("inf")))
    best = int(gap_e.argmax())
    runner_up = gap_e.topk(5)
    peak = 0.0
    for t in POSITIVE:
        with sm.record(sae.site) as cache:
            sm.forward([t], chat=False)
        peak = max(peak, float(sae.encode(cache[sae.site][0, 1:].float(), [best]).max()))
    return {"latent": best, "gap": float(gap[best]), "mean_joyful": float(pos[:, best].mean()),
            "mean_gloomy": float(neg[:, best].mean()), "fires_on_joyful": int((pos[:, best] > 0).sum()),
            "fires_on_gloomy": int((neg[:, best] > 0).sum()), "peak_on_joyful": peak,
            "top5": [(int(i), float(v)) for v, i in zip(runner_up.values, runner_up.indices)]}


def diff_of_means(sm, site: str) -> torch.Tensor:
    with sm.record(site, positions="last") as cache:
        sm.forward(POSITIVE, chat=True)
        sm.forward(NEGATIVE, chat=True)
    acts = cache[site].float()
    return acts[: len(POSITIVE)].mean(0) - acts[len(POSITIVE):].mean(0)


def lexicon(text: str) -> int:
    words = re.findall(r"[a-z]+", text.lower())
    return sum(w in JOYFUL for w in words) - sum(w in GLOOMY for w in words)


def measure(sm, steering, prompts: list[str], n_new: int, joy_ids: list[int], gloom_ids: list[int]) -> dict:
    """Log-odds of the first answer token, lexicon score and NLL of greedy answers under the plain model."""
    with (sm.steer(*steering) if steering else contextlib.nullcontext()):
        logits = sm.forward(prompts, chat=True)
        logits = (logits.logits if hasattr(logits, "logits") else logits)
        answers = sm.generate(prompts, n_new, chat=True)
    toks = sm.tokenize(prompts, chat=True)
    mask = toks.attention_mask
    last = (mask * torch.arange(mask.shape[1])).argmax(1)  # each row's last real token, whatever the padding
    lp = torch.log_softmax(logits.float()[torch.arange(len(prompts)), last], -1)
    odds = (lp[:, joy_ids].logsumexp(-1) - lp[:, gloom_ids].logsumexp(-1))
    nll = []
    for p, a in zip(prompts, answers):
        full = sm.tokenize([p], chat=True).input_ids[0].tolist()
        ans = sm.tokenizer.encode(a, add_special_tokens=False)
        if not ans:
            continue
        ids = torch.tensor([full + ans])
        with torch.no_grad():
            out = sm.hf_model(input_ids=ids.to(sm.device)).logits.float()[0].cpu()  # the plain model
        lps = torch.log_softmax(out[len(full) - 1:-1], -1).gather(-1, ids[0, len(full):, None])
        nll.append(float(-lps.mean()))
    lex = [lexicon(a) for a in answers]
    return {"log_odds": round(float(odds.mean()), 4), "log_odds_se": round(float(odds.std() / len(odds) ** 0.5), 4),
            "lexicon": round(sum(lex) / len(lex), 4), "joyful_answers": sum(x > 0 for x in lex),
            "nll": round(sum(nll) / max(1, len(nll)), 4), "answers": answers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sae", required=True, help="the trained SAE's folder (steerkit sae train's OUT/layers.L)")
    ap.add_argument("--quick", action="store_true", help="4 prompts, one strength each, 16 new tokens")
    ap.add_argument("--strengths", default="16,32,64", help="norms of the added vectors (default 16,32,64)")
    ap.add_argument("--clamps", default="1,2,4", help="clamp values as multiples of the latent's joyful peak (default 1,2,4)")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--out", default="sae-steering.json")
    a = ap.parse_args(argv)
    t0 = time.time()
    sm = steerkit.load_model()
    sae = steerkit.load_sae(a.sae, model=sm)
    site = sae.site
    prompts = HELD_OUT[:4] if a.quick else HELD_OUT
    strengths = [float(x) for x in a.strengths.split(",")][: 1 if a.quick else None]
    clamps = [float(x) for x in a.clamps.split(",")][: 1 if a.quick else None]
    n_new = 16 if a.quick else a.new_tokens
    found = find_latent(sm, sae)
    i = found["latent"]
    print(f"latent {i}: gap {found['gap']:.3f} (joyful {found['mean_joyful']:.3f}, gloomy {found['mean_gloomy']:.3f}),"
          f" fires on {found['fires_on_joyful']}/8 joyful and {found['fires_on_gloomy']}/8 gloomy statements")
    paragraphs = [p.strip() for d in read_corpus(None) for p in d.split("\n\n") if 100 <= len(p.strip()) <= 600]
    corpus = paragraphs[:: max(1, len(paragraphs) // (60 if a.quick else 300))]  # spread over the whole corpus
    rep = feature_report(sm, sae, i, POSITIVE + NEGATIVE + corpus, top=10, progress=True)
    print(rep)
    dm = diff_of_means(sm, site)
    row = sae.weights.W_dec[i].float()
    cos = float(torch.nn.functional.cosine_similarity(row, dm, dim=0))
    print(f"cosine(decoder row, difference of means) = {cos:.3f}; |W_dec[i]| = {row.norm():.3f}")
    joy_ids, gloom_ids = first_tokens(sm, JOYFUL), first_tokens(sm, GLOOMY)
    conditions = [("unsteered", 0.0, [])]
    pos = AnyOf(slice(1, None), "generated")  # every token but the first (the attention sink, see find_latent)
    conditions += [(f"clamp x{c:g}", c * found["peak_on_joyful"],
                    [Intervention.sae_latent(site, sae, i, value=c * found["peak_on_joyful"], positions=pos)])
                   for c in clamps]
    conditions += [(f"add {s:g}", s, [Intervention.sae_latent(site, sae, i, scale=s / float(row.norm()), mode="add",
                                                              positions=pos)]) for s in strengths]
    conditions += [(f"diffmean {s:g}", s, [Intervention.add(site, dm / dm.norm(), s, positions=pos)])
                   for s in strengths]
    results = {}
    for name, strength, steering in tqdm(conditions, desc="conditions", file=sys.stderr):
        results[name] = {"strength": strength, **measure(sm, steering, prompts, n_new, joy_ids, gloom_ids)}
        r = results[name]
        print(f"{name:<14} log-odds {r['log_odds']:+.3f} ± {r['log_odds_se']:.3f}  lexicon {r['lexicon']:+.3f} "
              f"({r['joyful_answers']}/{len(prompts)} joyful)  nll {r['nll']:.3f}")
    att = latent_attribution(sm, sae, IOI[0], IOI[1], logit_diff_metric(sm, " Mary", " John"), check=20)
    print(f"IOI attribution: r = {att.pearson_r:.3f}, top latent in top 3 by patching: {att.top_in_top3}")
    out = {"model": sm.name, "sae": str(a.sae), "site": site, "d_sae": sae.d_sae, "found": found,
           "report": {k: v for k, v in rep.to_dict().items() if k != "values"}, "cos_decoder_diffmean": cos,
           "diffmean_norm": float(dm.norm()), "prompts": prompts, "new_tokens": n_new, "conditions": results,
           "attribution": {"clean": IOI[0], "corrupted": IOI[1], "pearson_r": att.pearson_r,
                           "top_in_top3": att.top_in_top3, "clean_metric": att.clean_metric,
                           "corrupted_metric": att.corrupted_metric, "checked": att.checked,
                           "patching": att.patching, "attribution": [float(att.values[j]) for j in att.checked]},
           "seconds": round(time.time() - t0, 1)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {a.out} in {out['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
