"""Recording SAE latents during the forward pass: steerkit vs sae-lens's HookedSAETransformer, same model, same SAE.

The default model (SmolLM2-135M-Instruct) and one TopK SAE at ``blocks.12.hook_resid_post`` (the trained one at
``--sae``, by default ``/work/sae-runs/sae-smollm2-l12/layers.12`` when that folder exists; otherwise a random TopK
SAE, d_sae 9216, k 32, seed 0). The batch: ``--prompts`` rows of ``--tokens`` tokens of the vendored corpus
(``steerkit.probes.token_chunks``: real text, every row the same length, so no padding), float32, one torch thread
per process. Five conditions, timed in one run:

  steerkit-bare            ``sm.forward(tokens)``
  steerkit-record          the same inside ``sm.record("{site}.hook_sae_acts_post")`` with the SAE attached
                           (``sm.attach_sae(sae)``, outside the clock): the model's output unchanged, the latents
                           recorded (steerkit encodes only: nothing asks for the reconstruction)
  saelens-bare             ``model(tokens)`` on a ``HookedSAETransformer`` with no SAE
  saelens-cache            ``model.run_with_cache(tokens, names_filter=["{site}.hook_sae_acts_post"])`` with the SAE
                           attached by ``model.add_sae(sae, use_error_term=True)`` outside the clock (the model's
                           output unchanged, as steerkit's recording; sae-lens then encodes and decodes twice, once
                           for the error term)
  saelens-cache-splice     the same with ``use_error_term=False`` (one encode and decode; the model runs on the
                           reconstruction)

sae-lens 6 pins TransformerLens 3, which cannot be installed beside steerkit's TransformerLens 4, so its side runs in
``.venv-saelens`` (``scripts/setup.sh``; ``STEERKIT_SAELENS_PYTHON`` points elsewhere) as a worker process of this
script that stays up for the whole run and times each of its passes when asked (its own CPU and wall time), so the
conditions of both libraries interleave: after ``--warmup`` passes of each, ``--repeats`` rounds run every condition
once, in an order rotated each round, and the medians are compared. TransformerLens 3 has no SmolLM2 configuration:
the worker builds a ``HookedTransformerConfig`` for the Llama architecture from the model's ``config.json`` and loads
the same weights (the HF model steerkit runs, written with ``save_pretrained``) with TransformerLens's
``convert_llama_weights``, without folding or centring anything. The SAE reaches sae-lens as steerkit writes it
(``SAE.save(path, "saelens")``, read by ``sae_lens.SAE.load_from_disk``).

Before timing, the two must agree: one pass of each on the batch, and the latents of steerkit and of sae-lens
compared (``agreement`` row: the largest differences of the logits, of the SAE's input and of the latents; for a
TopK SAE on the rows whose k-th and (k+1)-th pre-activations differ by more than 1e-3, where rounding cannot change
which latents fire, and the number of rows whose active set differs). The script stops (exit 1) when a decided row's
latents differ by more than ``--rtol`` (1e-4) times the row's largest latent (relative to each row: the residual of
a row's first token is orders of magnitude larger than the others', and float32 rounding with it). Also sae-lens's ``SAE.encode`` of steerkit's own recorded activations
against steerkit's latents (the SAE alone, without the two models' rounding).

Prints prompts/s and tokens/s of each condition on the chosen clock (``--clock``: CPU time by default, as the other
benchmarks), each library's recording against its own bare pass, and steerkit's recording against sae-lens's: as the
ratio of the medians and paired (``paired_*``: the median over rounds of the ratio of two conditions' times in the
same round, which are neighbours in time; steadier on a shared machine).

Usage:  python benchmarks/bench_sae_record.py              # 16 prompts x 64 tokens, 2 warm-ups, 7 repeats
        python benchmarks/bench_sae_record.py --quick      # 4 prompts x 32 tokens, 1 warm-up, 2 repeats

Rows go to ``benchmarks/results/sae_record.csv`` (``--out``): one per condition and one ``agreement`` row.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TRAINED = Path("/work/sae-runs/sae-smollm2-l12/layers.12")
SAELENS_PY = Path(os.environ.get("STEERKIT_SAELENS_PYTHON") or C.ROOT / ".venv-saelens" / "bin" / "python")
CONDS = ("steerkit-bare", "steerkit-record", "saelens-bare", "saelens-cache", "saelens-cache-splice")
REPLY = "@@ "  # the worker's answers on stdout start with this (anything else it prints is passed over)
GAP = 1e-3  # a TopK row counts as decided when its k-th and (k+1)-th pre-activations differ by more than this


# --- worker: runs in .venv-saelens (torch, transformers, TransformerLens 3, sae-lens; no steerkit) -------------------
def tl_config(hf: dict, n_ctx: int):
    """A ``HookedTransformerConfig`` of the Llama architecture in the HF ``config.json`` ``hf`` (what TransformerLens's
    ``convert_hf_model_config`` writes for ``LlamaForCausalLM``), float32 on the CPU, with a context of ``n_ctx``
    (TransformerLens keeps an ``n_ctx x n_ctx`` mask per layer)."""
    import torch
    from transformer_lens import HookedTransformerConfig

    heads = hf["num_attention_heads"]
    d_head = hf.get("head_dim") or hf["hidden_size"] // heads
    kv = hf.get("num_key_value_heads") or heads
    rope = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta") or 10000.0
    return HookedTransformerConfig(
        d_model=hf["hidden_size"], d_head=d_head, n_heads=heads, d_mlp=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"], n_ctx=min(n_ctx, hf["max_position_embeddings"]), eps=hf["rms_norm_eps"],
        d_vocab=hf["vocab_size"], act_fn=hf["hidden_act"], n_key_value_heads=kv if kv != heads else None,
        normalization_type="RMS", positional_embedding_type="rotary", rotary_adjacent_pairs=False, rotary_dim=d_head,
        rotary_base=rope, final_rms=True, gated_mlp=True, original_architecture="LlamaForCausalLM",
        tokenizer_prepends_bos=False, default_prepend_bos=False, dtype=torch.float32, device="cpu")


def worker() -> int:
    """The sae-lens side: a JSON config on the first stdin line, then one JSON command per line
    (``check``, ``run``, ``quit``); each answer is a line ``@@ {json}`` on stdout."""
    import torch
    from safetensors.torch import load_file, save_file

    def reply(obj: dict) -> None:
        print(REPLY + json.dumps(obj), flush=True)

    cfg = json.loads(sys.stdin.readline())
    try:
        from importlib.metadata import version

        import sae_lens
        from sae_lens import SAE, HookedSAETransformer
        from transformer_lens.pretrained.weight_conversions import convert_llama_weights
        from transformers import AutoModelForCausalLM

        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        t0 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(cfg["hf"], dtype=torch.float32).eval()
        hf_cfg = json.loads((Path(cfg["hf"]) / "config.json").read_text())
        tcfg = tl_config(hf_cfg, cfg["n_ctx"])
        model = HookedSAETransformer(tcfg)
        with torch.no_grad():
            model.load_and_process_state_dict(convert_llama_weights(hf, tcfg), fold_ln=False,
                                              center_writing_weights=False, center_unembed=False,
                                              fold_value_biases=False, refactor_factored_attn_matrices=False)
        model.eval()
        del hf
        sae = SAE.load_from_disk(cfg["sae"], device="cpu")
        tokens = load_file(cfg["tokens"])["ids"]
        site = sae.cfg.metadata.hook_name
        acts = f"{site}.hook_sae_acts_post"
        reply({"ok": True, "load_s": time.perf_counter() - t0, "sae_lens": sae_lens.__version__,
               "transformer_lens": version("transformer_lens"), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "site": site, "architecture": sae.cfg.architecture()})
    except Exception as e:  # noqa: BLE001 - the main process reports it
        reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    attached: list = [None]  # None (no SAE), True / False (attached with that use_error_term)

    def attach(error_term) -> None:
        if attached[0] is error_term:
            return
        model.reset_saes()
        if error_term is not None:
            model.add_sae(sae, use_error_term=error_term)
        attached[0] = error_term

    def run(cond: str):
        if cond == "saelens-bare":
            attach(None)
            return lambda: model(tokens)
        attach(cond == "saelens-cache")
        return lambda: model.run_with_cache(tokens, names_filter=[acts])[1][acts]

    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "quit":
                break
            with torch.no_grad():
                if msg["op"] == "check":
                    attach(True)
                    logits_sae, cache = model.run_with_cache(tokens, names_filter=[acts, f"{site}.hook_sae_input"])
                    attach(None)
                    logits = model(tokens)
                    theirs = load_file(msg["steerkit"])
                    save_file({"logits": logits.contiguous(), "logits_sae": logits_sae.contiguous(),
                               "input": cache[f"{site}.hook_sae_input"].contiguous(), "acts": cache[acts].contiguous(),
                               "acts_of_steerkit_input": sae.encode(theirs["input"]).contiguous()}, msg["out"])
                    reply({"ok": True})
                elif msg["op"] == "run":
                    fn = run(msg["cond"])
                    with C.Clock() as clk:
                        fn()
                    reply({"ok": True, "wall": clk.wall, "cpu": clk.cpu})
                else:
                    reply({"ok": False, "error": f"unknown command {msg['op']!r}"})
        except Exception as e:  # noqa: BLE001 - the main process reports it
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
    return 0


# --- main process (steerkit's environment) ---------------------------------------------------------------------------
class SaeLensWorker:
    """The worker process in ``.venv-saelens``: ``ask(cmd)`` sends one command and returns its answer."""

    def __init__(self, py: Path, cfg: dict, log_path: Path, timeout: float = 900):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["PYTHONPATH"] = str(C.ROOT / "benchmarks")  # _common only (stdlib); steerkit stays out of that env
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen([str(py), str(Path(__file__).resolve()), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=log_path.parent, env=env)
        self.info = self.ask(cfg, timeout=timeout)

    def ask(self, cmd: dict, timeout: float = 900) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        t = time.monotonic()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                ans = json.loads(line[len(REPLY):])
                if not ans.get("ok"):
                    raise RuntimeError(f"sae-lens worker: {ans.get('error')}")
                return ans
            if time.monotonic() - t > timeout:
                break
        self.proc.poll()
        tail = self.log_path.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"sae-lens worker ended (exit {self.proc.returncode}) without answering: {' / '.join(tail)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"}, timeout=5)
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def random_topk_sae(sm, site: str, d_sae: int = 9216, k: int = 32, seed: int = 0):
    """A random TopK SAE at ``site`` of ``sm``: unit encoder columns, the decoder their transpose."""
    import torch

    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, Provenance

    g = torch.Generator().manual_seed(seed)
    W = torch.nn.functional.normalize(torch.randn(d_sae, sm.d_model, generator=g), dim=-1)
    w = SAEWeights(W.T.contiguous(), torch.randn(d_sae, generator=g) * 0.05, W.clone(), torch.zeros(sm.d_model),
                   architecture="topk", k=k)
    return SAE(w, site, provenance=Provenance.from_model(sm))


def save_hf(sm, folder: Path) -> Path:
    """The HF model steerkit runs, written with ``save_pretrained``, float32. A model loaded from a GGUF keeps
    transformers' GGUF quantizer, which refuses to save (its weights are already de-quantized floats): it is set
    aside for the save, and the GGUF entry left out of ``config.json`` (it would make transformers look for the
    GGUF file)."""
    model = sm.hf_model
    quantizer = getattr(model, "hf_quantizer", None)
    model.hf_quantizer = None
    try:
        model.save_pretrained(folder)
    finally:
        model.hf_quantizer = quantizer
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return folder


def decided_rows(pre, k: int):
    """The rows of TopK pre-activations ``pre`` ``[n, d_sae]`` whose k-th and (k+1)-th values differ by more than
    :data:`GAP` (which latents fire there does not depend on rounding)."""
    import torch
    top = torch.topk(pre, k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) > GAP


def agreement(sm, sae, toks, worker: SaeLensWorker, tmp: Path, rtol: float) -> dict:
    """One pass of each library on ``toks``: the largest differences of logits, SAE input and latents."""
    import torch
    from safetensors.torch import load_file, save_file

    site = sae.site
    names = [site, f"{site}.hook_sae_input", f"{site}.hook_sae_acts_post"]
    with sm.attach_sae(sae), sm.record(names) as cache:
        logits_sae = sm.forward(toks)
    logits = sm.forward(toks)
    ours = {"input": cache[names[1]].float().contiguous(), "acts": cache[names[2]].float().contiguous()}
    save_file(ours, tmp / "steerkit_check.safetensors")
    worker.ask({"op": "check", "steerkit": str(tmp / "steerkit_check.safetensors"),
                "out": str(tmp / "saelens_check.safetensors")})
    theirs = load_file(tmp / "saelens_check.safetensors")

    def mad(a, b) -> float:
        return float((a.double() - b.double()).abs().max())

    f, g = ours["acts"].flatten(0, 1), theirs["acts"].flatten(0, 1)
    w = sae.weights
    rows = torch.ones(f.shape[0], dtype=torch.bool)
    if w.architecture == "topk":
        x = ours["input"].flatten(0, 1)
        pre = (x - w.b_dec if w.apply_b_dec_to_input else x) @ w.W_enc + w.b_enc
        rows = decided_rows(pre, int(w.k))
    diff_sets = int(((f != 0) != (g != 0)).any(-1).sum())
    # each row's largest difference over its largest latent: the residual's scale differs by orders of magnitude
    # between a row's first token and the others, and float32 rounding with it
    row_rel = (f - g).abs().amax(-1) / f.abs().amax(-1).clamp_min(1e-6)
    out = {"kind": "agreement", "rows": f.shape[0], "decided_rows": int(rows.sum()),
           "rows_with_other_active_set": diff_sets,
           "latents_max_abs_diff": mad(f[rows], g[rows]), "latents_max_abs_diff_all_rows": mad(f, g),
           "latents_max_abs": float(f.abs().max()),
           "latents_max_rel_diff_per_row": float(row_rel[rows].max()),
           "sae_input_max_abs_diff": mad(ours["input"], theirs["input"]),
           "sae_input_max_abs": float(ours["input"].abs().max()),
           "logits_max_abs_diff": mad(logits, theirs["logits"]),
           "logits_with_sae_max_abs_diff": mad(logits_sae, theirs["logits_sae"]),
           "saelens_encode_of_steerkit_input_max_abs_diff": mad(ours["acts"], theirs["acts_of_steerkit_input"]),
           "rtol": rtol}
    out["agree"] = out["latents_max_rel_diff_per_row"] <= rtol
    return out


def measure(sm, sae, toks, worker: SaeLensWorker, warmup: int, repeats: int, log) -> dict:
    """Interleaved timings of every condition: ``{cond: {"wall": [...], "cpu": [...]}}``."""
    import torch

    acts = f"{sae.site}.hook_sae_acts_post"

    def steerkit_bare():
        with C.Clock() as clk:
            sm.forward(toks)
        return clk.wall, clk.cpu

    def steerkit_record():
        with sm.attach_sae(sae):  # attached outside the clock, as sae-lens's add_sae
            with C.Clock() as clk:
                with sm.record(acts) as cache:
                    sm.forward(toks)
                cache[acts]
        return clk.wall, clk.cpu

    def saelens(cond):
        def run():
            ans = worker.ask({"op": "run", "cond": cond})
            return ans["wall"], ans["cpu"]
        return run

    runners = {"steerkit-bare": steerkit_bare, "steerkit-record": steerkit_record,
               **{c: saelens(c) for c in CONDS if c.startswith("saelens")}}
    res = {c: {"wall": [], "cpu": []} for c in runners}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in runners.values():
                fn()
        conds = list(runners)
        for r in range(repeats):
            for c in conds[r % len(conds):] + conds[:r % len(conds)]:
                wall, cpu = runners[c]()
                res[c]["wall"].append(wall)
                res[c]["cpu"].append(cpu)
            log(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{c} {res[c]['cpu'][-1]:.2f}" for c in conds) + " (CPU s)")
    return res


def summary_rows(res: dict, n_prompts: int, n_tokens: int, clock: str, base: dict) -> list[dict]:
    other = "wall" if clock == "cpu" else "cpu"
    med = {c: statistics.median(v[clock]) for c, v in res.items()}
    med_o = {c: statistics.median(v[other]) for c, v in res.items()}
    own_bare = {c: ("steerkit-bare" if c.startswith("steerkit") else "saelens-bare") for c in res}

    def paired(c: str, ref: str) -> float:
        """The median over rounds of ``c``'s time over ``ref``'s in the same round (neighbours in time)."""
        return statistics.median(x / y for x, y in zip(res[c][clock], res[ref][clock]))
    rows = []
    for c in CONDS:
        if c not in res:
            continue
        lib, cond = c.split("-", 1)
        rows.append({**base, "kind": "throughput", "library": "steerkit" if lib == "steerkit" else "sae-lens",
                     "condition": cond, "prompts": n_prompts, "tokens_per_prompt": n_tokens,
                     "median_cpu_s": round(statistics.median(res[c]["cpu"]), 4),
                     "median_wall_s": round(statistics.median(res[c]["wall"]), 4),
                     "prompts_per_s": round(n_prompts / med[c], 3), "tokens_per_s": round(n_prompts * n_tokens / med[c], 1),
                     "throughput_vs_own_bare": round(med[own_bare[c]] / med[c], 4),
                     "throughput_vs_own_bare_other_clock": round(med_o[own_bare[c]] / med_o[c], 4),
                     "paired_throughput_vs_own_bare": round(1 / paired(c, own_bare[c]), 4),
                     "time_over_steerkit_record": round(med[c] / med["steerkit-record"], 3),
                     "time_over_steerkit_bare": round(med[c] / med["steerkit-bare"], 3),
                     "paired_time_over_steerkit_record": round(paired(c, "steerkit-record"), 3)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, 1 warm-up, 2 repeats")
    ap.add_argument("--prompts", type=int, default=None, help="rows in the batch (16; quick 4)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per row (64; quick 32)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed passes of each condition first (2; quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved timed rounds (7; quick 2)")
    ap.add_argument("--layer", type=int, default=12, help="block of the random SAE (blocks.L.hook_resid_post)")
    ap.add_argument("--sae", default=None, help=f"an SAE folder or file for steerkit.load_sae (default {TRAINED} when "
                    "it exists, else a random TopK SAE, d_sae 9216, k 32); 'random' forces the random one")
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest |steerkit - sae-lens| of a row's latents over the "
                    "row's largest latent, on the decided rows, before the script stops (default 1e-4)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process (default 1; 0 = torch's)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="time the figures use (default cpu: each process's CPU time); the other is printed too")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "sae_record.csv"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker()
    n_prompts = a.prompts or (4 if a.quick else 16)
    n_tokens = a.tokens or (32 if a.quick else 64)
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    repeats = a.repeats or (2 if a.quick else 7)

    def log(s: str) -> None:
        print(s, flush=True)

    if not SAELENS_PY.exists():
        log(f"no sae-lens environment at {SAELENS_PY}: scripts/setup.sh creates it (sae-lens==6.54.*); "
            "or point STEERKIT_SAELENS_PYTHON at one")
        return 2
    import torch
    from safetensors.torch import save_file

    import steerkit
    from steerkit.model import Tokens
    from steerkit.probes import read_corpus, token_chunks

    threads = C.set_threads(a.threads)
    sm = steerkit.load_model()
    path = Path(a.sae) if a.sae and a.sae != "random" else (TRAINED if a.sae is None and TRAINED.exists() else None)
    if path is not None:
        sae, sae_name = steerkit.load_sae(path, model=sm), str(path)
    else:
        sae, sae_name = random_topk_sae(sm, f"blocks.{a.layer}.hook_resid_post"), "random"
    w = sae.weights
    log(f"model {sm.name}; SAE {sae_name}: {w.architecture} at {sae.site}, d_sae {w.d_sae}, k {w.k}; "
        f"{n_prompts} prompts x {n_tokens} tokens; {threads} torch thread(s) per process; clock {a.clock}")
    ids = token_chunks(sm.tokenizer, read_corpus(), n_tokens, n_prompts * n_tokens, progress=False).ids[:n_prompts]
    if ids.shape[0] < n_prompts:
        log(f"the corpus gave {ids.shape[0]} rows of {n_tokens} tokens, fewer than {n_prompts}")
        return 2
    toks = Tokens(ids.to(sm.device), torch.ones_like(ids).to(sm.device))
    base = {"mode": "quick" if a.quick else "full", "sae": "trained" if path is not None else "random",
            "architecture": w.architecture, "site": sae.site, "d_sae": w.d_sae, "k": w.k, "threads": threads}
    with tempfile.TemporaryDirectory(prefix="steerkit-sae-record-") as d:
        tmp = Path(d)
        t = time.perf_counter()
        save_hf(sm, tmp / "hf")
        sae.save(tmp / "sae", "saelens")
        save_file({"ids": ids.contiguous()}, tmp / "tokens.safetensors")
        cfg = {"hf": str(tmp / "hf"), "sae": str(tmp / "sae"), "tokens": str(tmp / "tokens.safetensors"),
               "threads": a.threads, "n_ctx": max(2048, n_tokens)}
        worker_ = SaeLensWorker(SAELENS_PY, cfg, tmp / "worker.log")
        try:
            info = worker_.info
            log(f"sae-lens {info['sae_lens']}, TransformerLens {info['transformer_lens']}, torch {info['torch']}: "
                f"HookedSAETransformer and SAE ({info['architecture']}) ready in {time.perf_counter() - t:.0f} s")
            base.update({"sae_lens": info["sae_lens"], "transformer_lens": info["transformer_lens"]})
            agree = agreement(sm, sae, toks, worker_, tmp, a.rtol)
            log(C.table(["check", "max |steerkit - sae-lens|", "scale (max |steerkit|)"], [
                ["logits, no SAE", f"{agree['logits_max_abs_diff']:.3g}", ""],
                ["logits, SAE recorded (sae-lens: error term on)", f"{agree['logits_with_sae_max_abs_diff']:.3g}", ""],
                ["SAE input (hook_resid_post)", f"{agree['sae_input_max_abs_diff']:.3g}",
                 f"{agree['sae_input_max_abs']:.3g}"],
                [f"latents, {agree['decided_rows']}/{agree['rows']} decided rows",
                 f"{agree['latents_max_abs_diff']:.3g}", f"{agree['latents_max_abs']:.3g}"],
                ["latents, decided rows: the largest of a row's over its largest latent",
                 f"{agree['latents_max_rel_diff_per_row']:.3g}", ""],
                ["latents, every row", f"{agree['latents_max_abs_diff_all_rows']:.3g}", ""],
                ["sae-lens SAE.encode of steerkit's input vs steerkit's latents",
                 f"{agree['saelens_encode_of_steerkit_input_max_abs_diff']:.3g}", ""]],
                title=f"agreement ({agree['rows_with_other_active_set']} rows with another active set)"))
            if not agree["agree"]:
                log(f"steerkit's and sae-lens's latents differ by {agree['latents_max_rel_diff_per_row']:.3g} of a "
                    f"row's largest latent > --rtol {a.rtol} on the decided rows: not timing")
                C.csv_rows(Path(a.out), [{**base, **agree}])
                return 1
            res = measure(sm, sae, toks, worker_, warmup, repeats, log)
        finally:
            worker_.close()
    rows = summary_rows(res, n_prompts, n_tokens, a.clock, base)
    other = "wall" if a.clock == "cpu" else "cpu"
    log(C.table(["library", "condition", f"median {a.clock} s", "prompts/s", "tokens/s", "vs own bare",
                 f"vs own bare ({other})", "vs own bare, paired", "time / steerkit record", "same, paired"],
                [[r["library"], r["condition"], r[f"median_{a.clock}_s"], r["prompts_per_s"], r["tokens_per_s"],
                  r["throughput_vs_own_bare"], r["throughput_vs_own_bare_other_clock"],
                  r["paired_throughput_vs_own_bare"], r["time_over_steerkit_record"],
                  r["paired_time_over_steerkit_record"]] for r in rows],
                title=f"throughput ({a.clock} clock; paired: the median over rounds of the ratio within a round)"))
    rec = next(r for r in rows if r["condition"] == "record")
    sl = next(r for r in rows if r["condition"] == "cache")
    log(f"steerkit records the latents {sl['paired_time_over_steerkit_record']:.2f}x as fast as sae-lens's "
        f"run_with_cache (error term on; paired); recording keeps {rec['paired_throughput_vs_own_bare']:.3f} of "
        f"steerkit's bare throughput, sae-lens {sl['paired_throughput_vs_own_bare']:.3f} of its own (paired)")
    log(f"wrote {C.csv_rows(Path(a.out), rows + [{**base, **agree}])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
