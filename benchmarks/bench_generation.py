"""Steered greedy generation vs unsteered, steerkit next to nnsight, steering-vectors and repeng.

Two steering edits on the default model (SmolLM2-135M-Instruct, 30 layers):
  add     a fixed random vector (norm 4) added to the output of block 15 (``blocks.15.hook_resid_post``)
  ablate  one fixed random unit direction projected out of every block's output (30 sites)
each at batch 1 and batch 8, greedy, ``--tokens`` new tokens (64), every position (prompt + generated).

Every library is timed against its *own* unsteered baseline in the same process:
  steerkit          ``sm.generate`` (steerkit's KV-cache loop) with and without ``sm.edit(...)``
  nnsight           ``LanguageModel.generate`` with and without interventions (``tracer.all()``)
  steering-vectors  HF ``model.generate`` with and without ``SteeringVector.apply`` (own venv: transformers<5)
  repeng            HF ``model.generate`` on the plain model, and wrapped in ``ControlModel`` with a
                    control set (own venv: transformers<5, numpy<2)
Repeats are interleaved (base, add, ablate, base-2, in an order rotated every repeat); the overhead is
the median over repeats of ``steered / base`` of the same repeat (adjacent in time), with a bootstrap
95% interval; ``median(steered) / median(base) - 1`` is printed too. For steerkit, ``base-2`` (unsteered
again) is an A/A control: its "overhead" shows what noise alone produces in the same run. The ratio uses the process's CPU time by default (with one torch
thread it is what the run cost, whatever else the machine was doing); wall-time ratios are printed
next to it. Times are per generated step (a row that stops at EOS early would
otherwise look faster). All libraries get the same token ids (the chat template applied by steerkit).

Usage:  python benchmarks/bench_generation.py            # full: 64 tokens, 3 repeats
        python benchmarks/bench_generation.py --quick    # 8 tokens, 1 repeat, no side-venv creation

Summary rows go to ``benchmarks/results/generation.csv`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LAYER = 15
CONDS = ("base", "add", "ablate")
LIBS = ("steerkit", "nnsight", "steering-vectors", "repeng")


Clock = C.Clock


def interleave(runners: dict, batches, repeats: int, log) -> dict:
    """runners[cond](B) -> (Clock, steps). Returns {f"{cond}@{B}": {"wall": [], "cpu": [], "steps": []}}."""
    res = {f"{c}@{B}": {"wall": [], "cpu": [], "steps": []} for c in runners for B in batches}
    for B in batches:  # warm-up: one short run of each condition
        for fn in runners.values():
            fn(B, warm=True)
    conds = list(runners)
    for r in range(repeats):
        for B in batches:
            order = conds[r % len(conds):] + conds[:r % len(conds)]  # rotate: no condition always runs first
            for c in order:
                clk, steps = runners[c](B)
                res[f"{c}@{B}"]["wall"].append(clk.wall)
                res[f"{c}@{B}"]["cpu"].append(clk.cpu)
                res[f"{c}@{B}"]["steps"].append(steps)
                log(f"    rep {r + 1}/{repeats} B={B} {c:<6} wall {clk.wall:7.2f} s  cpu {clk.cpu:7.2f} s  ({steps} steps)")
    return res


# --- in-process libraries (project venv) ----------------------------------------------------
def bench_steerkit(sm, ids, cfg, log) -> dict:
    v, u = C.steering_vectors(sm.d_model)
    all_post = [f"blocks.{l}.hook_resid_post" for l in range(sm.n_layers)]
    T = cfg["tokens"]

    def gen(B, warm=False):
        toks = sm.pad(ids[:B])
        with Clock() as clk:
            out = sm.generate(toks, max_new_tokens=2 if warm else T, return_tokens=True)
        return clk, max(len(o) for o in out)

    def base(B, warm=False):
        return gen(B, warm)

    def add(B, warm=False):
        with sm.edit(f"blocks.{LAYER}.hook_resid_post", add=v):
            return gen(B, warm)

    def ablate(B, warm=False):
        with sm.edit(all_post, ablate=u):
            return gen(B, warm)

    # "base-2": unsteered again, the A/A control: its "overhead" is what the noise alone produces
    return interleave({"base": base, "add": add, "ablate": ablate, "base-2": base}, cfg["batches"],
                      cfg["repeats"], log)


def bench_nnsight(sm, ids, cfg, log) -> dict:
    import torch
    from nnsight import LanguageModel

    import warnings
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    lm = LanguageModel(sm.model, tokenizer=sm.tokenizer)
    v, u = C.steering_vectors(sm.d_model)
    layers = lm.model.layers
    T = cfg["tokens"]
    pad = sm.tokenizer.pad_token_id

    def run(B, edit, warm):
        toks = sm.pad(ids[:B])
        n = 2 if warm else T
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        inputs = {"input_ids": toks.input_ids, "attention_mask": toks.attention_mask}
        with Clock() as clk, torch.inference_mode():
            with lm.generate(inputs, **kw) as tracer:
                # every generation step: the prefill + n - 1 decode steps (a bounded range, so the
                # code after the loop runs)
                if edit == "add":
                    for _ in tracer.iter[:n]:
                        h = layers[LAYER].output
                        layers[LAYER].output = h + v
                elif edit == "ablate":
                    for _ in tracer.iter[:n]:
                        for l in range(len(layers)):
                            h = layers[l].output
                            layers[l].output = h - (h @ u).unsqueeze(-1) * u
                out = tracer.result.save()
        return clk, int(out.shape[1] - toks.input_ids.shape[1])

    return interleave({c: (lambda B, warm=False, c=c: run(B, c, warm)) for c in CONDS},
                      cfg["batches"], cfg["repeats"], log)


# --- worker (runs inside a side venv: only torch + transformers + the library) -------------
def worker(cfg: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    C.set_threads(cfg.get("threads"))
    lib = cfg["lib"]
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = C.tf4_model_folder(cfg["model_folder"])
    # steerkit's cache holds the tied embedding once, as ``lm_head.weight`` (safetensors.save_model);
    # transformers 4 would leave ``model.embed_tokens.weight`` on the meta device, so load by hand.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), torch_dtype=torch.float32)
    sd = load_file(str(folder / "model.safetensors"))
    if "model.embed_tokens.weight" not in sd and "lm_head.weight" in sd:
        sd["model.embed_tokens.weight"] = sd["lm_head.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.eval()
    d, L = model.config.hidden_size, model.config.num_hidden_layers
    v, u = C.steering_vectors(d)
    T, pad = cfg["tokens"], cfg["pad_token_id"]
    logs = []

    def hf_generate(B, warm):
        ids = cfg["ids"][:B]
        P = max(len(x) for x in ids)
        input_ids = torch.full((B, P), pad, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, P - len(x):] = torch.tensor(x)
            mask[i, P - len(x):] = 1
        n = 2 if warm else T
        with Clock() as clk, torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        return clk, int(out.shape[1] - P)

    if lib == "steering-vectors":
        from steering_vectors import SteeringVector, ablation_operator

        sv_add = SteeringVector({LAYER: v}, layer_type="decoder_block")
        sv_abl = SteeringVector({l: u for l in range(L)}, layer_type="decoder_block")

        def add(B, warm=False):
            with sv_add.apply(model, multiplier=1.0):
                return hf_generate(B, warm)

        def ablate(B, warm=False):
            with sv_abl.apply(model, operator=ablation_operator()):
                return hf_generate(B, warm)
    elif lib == "repeng":
        from repeng.control import BlockControlParams, ControlModel, model_layer_list

        def ablate_op(current, control):  # control = u * padding mask
            return current - (current * control).sum(-1, keepdim=True) * control

        def steered(B, warm, layer_ids, params):
            cm = ControlModel(model, layer_ids)  # wraps the blocks; unwrap() restores the plain model
            try:
                layers = model_layer_list(cm)
                for l in layer_ids:
                    layers[l].set_control(params)
                return hf_generate(B, warm)
            finally:
                cm.unwrap()

        def add(B, warm=False):
            return steered(B, warm, [LAYER], BlockControlParams(control=v))

        def ablate(B, warm=False):
            return steered(B, warm, list(range(L)), BlockControlParams(control=u, operator=ablate_op))
    else:
        raise SystemExit(f"unknown worker library {lib!r}")

    def base(B, warm=False):
        return hf_generate(B, warm)

    import importlib.metadata as md
    res = interleave({"base": base, "add": add, "ablate": ablate}, cfg["batches"], cfg["repeats"], logs.append)
    return {"lib": lib, "version": md.version(lib), "transformers": md.version("transformers"),
            "threads": torch.get_num_threads(), "results": res, "log": logs}


# --- driver -------------------------------------------------------------------------------
def summarize(name: str, res: dict, batches, clock: str, records: list | None = None) -> list[list]:
    """One row per (edit, batch); column 5 is the paired median ratio, column 6 its 95% upper bound.

    With ``records``, the same rows are appended to it as dicts of numbers (the CSV rows)."""
    other = "wall" if clock == "cpu" else "cpu"

    def per_step(r: dict, k: str) -> float:
        return C.median([t / max(s, 1) for t, s in zip(r[k], r["steps"])])

    rows = []
    for B in batches:
        base = res[f"base@{B}"]
        bstep = per_step(base, clock)
        for c in ("add", "ablate", "base-2"):
            if f"{c}@{B}" not in res:
                continue
            r = res[f"{c}@{B}"]
            step = per_step(r, clock)
            steps = sorted(set(r["steps"] + base["steps"]))
            # paired: each repeat's steered run against the base run of the same repeat (adjacent in time)
            pr = [(t / max(s, 1)) / (bt / max(bs, 1))
                  for t, s, bt, bs in zip(r[clock], r["steps"], base[clock], base["steps"])]
            lo, hi = C.boot_ci(pr)
            rows.append([name, c, B, f"{bstep * 1e3:.1f}", f"{step * 1e3:.1f}", C.median(pr), hi,
                         f"{(step / bstep - 1) * 100:+.1f}%",
                         f"{(C.median(pr) - 1) * 100:+.1f}% [{(lo - 1) * 100:+.1f}, {(hi - 1) * 100:+.1f}]",
                         f"{(per_step(r, other) / per_step(base, other) - 1) * 100:+.1f}%",
                         "/".join(map(str, steps))])
            if records is not None:
                records.append({"edit": c, "batch": B, "clock": clock,
                                "base_ms_per_step": round(bstep * 1e3, 2), "steered_ms_per_step": round(step * 1e3, 2),
                                "overhead_pct": round((step / bstep - 1) * 100, 2),
                                "paired_overhead_pct": round((C.median(pr) - 1) * 100, 2),
                                "ci_lo_pct": round((lo - 1) * 100, 2), "ci_hi_pct": round((hi - 1) * 100, 2),
                                "overhead_other_clock_pct": round(
                                    (per_step(r, other) / per_step(base, other) - 1) * 100, 2),
                                "steps": "/".join(map(str, steps))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 tokens, 1 repeat, no side-venv creation")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per generation (64; quick 8)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (3; quick 1)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--libs", default=",".join(LIBS), help=f"comma list from {LIBS}")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in every process (default 1: steadier on a shared machine; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="time the ratios use: the process's CPU time (default; robust to other load on a shared "
                         "machine when --threads 1) or wall time; the other is printed too")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile one steerkit ablate-at-every-layer generation (batch 1) and list steerkit's share")
    ap.add_argument("--no-setup", action="store_true", help="do not create missing side venvs; skip those libraries")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "generation.csv"),
                    help="CSV of the summary rows (one per library, edit and batch)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        print(json.dumps(worker(json.loads(sys.stdin.read()))))
        return 0

    tokens = a.tokens or (8 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    batches = [int(b) for b in a.batches.split(",")]
    libs = [l.strip() for l in a.libs.split(",") if l.strip()]
    no_setup = a.no_setup or a.quick

    def log(s: str) -> None:
        print(s, flush=True)


    import torch
    import steerkit
    from steerkit.loading.resolve import default_gguf_path, hf_folder_for_gguf

    threads = C.set_threads(a.threads)
    t0 = time.perf_counter()
    sm = steerkit.load_model()
    log(f"model {sm.name}: {sm.n_layers} layers, d_model {sm.d_model}; loaded in {time.perf_counter() - t0:.1f} s; "
        f"torch {torch.__version__}, {threads} thread(s); {tokens} new tokens, batches {batches}, {repeats} repeat(s)")
    ids = [sm.tokenize(p, chat=True).input_ids[0].tolist() for p in C.prompts(max(batches))]
    cfg = {"tokens": tokens, "batches": batches, "repeats": repeats, "threads": a.threads,
           "ids": ids, "pad_token_id": sm.tokenizer.pad_token_id,
           "model_folder": str(hf_folder_for_gguf(default_gguf_path()))}

    results, notes, rows, records = {}, [], [], []
    for lib in libs:
        log(f"== {lib}")
        t = time.perf_counter()
        try:
            if lib == "steerkit":
                res, ver = bench_steerkit(sm, ids, cfg, log), steerkit.__version__ if hasattr(steerkit, "__version__") else "dev"
            elif lib == "nnsight":
                import importlib.metadata as md
                res, ver = bench_nnsight(sm, ids, cfg, log), md.version("nnsight")
                sm.reset()
            elif lib in C.SIDE_ENVS:
                py, why = C.ensure_side_env(lib, create=not no_setup, log=log)
                if py is None:
                    raise RuntimeError(why)
                out = C.run_worker(py, Path(__file__).resolve(), dict(cfg, lib=lib), timeout=3600)
                for line in out["log"]:
                    log(line)
                res, ver = out["results"], f"{out['version']} (transformers {out['transformers']}, own venv)"
            else:
                raise RuntimeError(f"unknown library {lib!r}")
        except Exception as e:  # noqa: BLE001 - one library failing must not stop the others
            msg = f"{lib}: could not run: {e}"
            log("  " + msg)
            notes.append(msg)
            continue
        log(f"  done in {time.perf_counter() - t:.0f} s")
        results[lib] = {"version": ver, "results": res}
        recs: list[dict] = []
        rows += summarize(f"{lib} {ver}".split(" (")[0], res, batches, a.clock, recs)
        records += [{"mode": "quick" if a.quick else "full", "library": lib, "version": str(ver).split(" (")[0],
                     **r, "tokens": tokens, "repeats": repeats, "threads": threads} for r in recs]

    print()
    other = "wall" if a.clock == "cpu" else "cpu"
    shown = [r[:5] + r[7:] for r in rows]
    print(C.table(["library", "edit", "batch", f"base {a.clock} ms/step", f"steered {a.clock} ms/step",
                   "overhead (ratio of medians)", "paired overhead: median [95% CI]", f"overhead ({other})",
                   "steps"],
                  shown, title=f"Steered vs unsteered greedy generation ({tokens} new tokens, {repeats} interleaved "
                               f"repeats, {a.clock} time per step; 'base-2' is an unsteered A/A control; target "
                               f"for steerkit: overhead <= 3%)"))
    for lib, r in results.items():
        print(f"  {lib}: {r['version']}")
    sk = [r for r in rows if r[0].startswith("steerkit") and r[1] != "base-2"]
    if sk:
        worst = max(sk, key=lambda r: r[5])
        worst_hi = max(sk, key=lambda r: r[6])
        print(f"steerkit worst paired overhead: {(worst[5] - 1) * 100:+.1f}% ({worst[1]}, batch {worst[2]}) -> "
              f"target <= 3%: {'MET' if worst[5] <= 1.03 else 'NOT MET'}; largest 95% upper bound "
              f"{(worst_hi[6] - 1) * 100:+.1f}% ({worst_hi[1]}, batch {worst_hi[2]}): "
              f"{'resolved' if worst_hi[6] <= 1.03 else 'not resolved at this many repeats'}")
    for n in notes:
        print("note: " + n)
    if a.profile:
        import cProfile
        v, u = C.steering_vectors(sm.d_model)
        prof = cProfile.Profile()
        with sm.edit([f"blocks.{l}.hook_resid_post" for l in range(sm.n_layers)], ablate=u):
            prof.enable()
            sm.generate(sm.pad(ids[:1]), max_new_tokens=tokens)
            prof.disable()
        print()
        print(C.profile_report(prof, f"steerkit generate, ablate at 30 layers, batch 1, {tokens} tokens"))
    if records:
        print(f"wrote {len(records)} rows to {C.csv_rows(Path(a.out), records)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cfg": {k: v for k, v in cfg.items() if k != "ids"},
                                            "results": results, "notes": notes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
