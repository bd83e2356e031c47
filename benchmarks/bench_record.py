"""Recording ``hook_resid_post`` at every layer (last prompt token) vs a bare forward pass.

Throughput: the prompts are tokenized once into batches (``--batch``, 32); for each batch a bare
``sm.forward`` and a forward inside ``sm.record(<all 30 hook_resid_post>, positions="last",
device="cpu")`` (with ``cache.stack()``, i.e. the finished ``[30, batch, 576]`` tensor, inside the
timing) run back to back, the order alternating from batch to batch. Throughput ratio =
total bare time / total recorded time (target >= 0.9), on the process's CPU time by default
(one torch thread) with the wall-time ratio printed next to it.

Memory: for N = 128, 256, 512 prompts (quick: 16, 32, 64) in turn, in this process: a bare pass
over the N prompts, then one record scope over the same N prompts, each under a sampler thread
that reads the RSS every 10 ms. The table gives both peaks, their difference (what recording
adds), the size of the output ``[30, N, 576]`` float32, and the peak of Python-level allocations
inside the record scope (tracemalloc). Flat = record - bare does not grow with N beyond the output.

``--profile`` adds a cProfile of the recorded passes with steerkit's own functions listed.

Usage:  python benchmarks/bench_record.py            # 512 prompts
        python benchmarks/bench_record.py --quick    # 32 prompts, memory at 16/32/64

Rows go to ``benchmarks/results/record.csv`` (``--out``: throughput) and ``record_memory.csv`` next
to it (the memory runs).
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import sys
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


Clock = C.Clock


class RssPeak:
    """Peak resident set size (bytes) sampled every ``dt`` seconds while the block runs."""

    def __init__(self, dt: float = 0.01):
        import psutil
        self.proc, self.dt = psutil.Process(), dt

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def __enter__(self):
        self.start = self.peak = self.rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.dt)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 prompts in batches of 16; memory at 16/32/64 prompts")
    ap.add_argument("--prompts", type=int, default=None, help="prompts for the throughput pass (512; quick 32)")
    ap.add_argument("--batch", type=int, default=None, help="prompts per batch (32; quick 16)")
    ap.add_argument("--mem-sizes", default=None, help="comma list of prompt counts for the memory runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--malloc-trim", action="store_true",
                    help="call glibc malloc_trim(0) after every batch of the memory runs (tests whether RSS growth "
                         "is heap fragmentation; compare with MALLOC_MMAP_THRESHOLD_=131072 in the environment)")
    ap.add_argument("--profile", action="store_true", help="cProfile the recorded passes and list steerkit's share")
    ap.add_argument("--out", default=str(C.ROOT / "benchmarks" / "results" / "record.csv"),
                    help="CSV of the throughput row; the memory rows go to <stem>_memory.csv next to it")
    a = ap.parse_args(argv)

    import torch
    import steerkit

    N = a.prompts or (32 if a.quick else 512)
    a.batch = a.batch or (16 if a.quick else 32)
    mem_sizes = [int(x) for x in (a.mem_sizes or ("16,32,64" if a.quick else "128,256,512")).split(",")]
    threads = C.set_threads(a.threads)
    t0 = time.perf_counter()
    sm = steerkit.load_model()
    names = [f"blocks.{l}.hook_resid_post" for l in range(sm.n_layers)]
    print(f"model {sm.name}: {sm.n_layers} layers, d_model {sm.d_model}; loaded in {time.perf_counter() - t0:.1f} s; "
          f"torch {torch.__version__}, {threads} thread(s); batch {a.batch}", flush=True)

    def batches(n):
        ps = C.prompts(n)
        return [sm.tokenize(ps[i:i + a.batch], chat=True) for i in range(0, n, a.batch)]

    # warm-up
    toks = batches(a.batch)[0]
    sm.forward(toks)
    with sm.record(names, positions="last", device="cpu") as cache:
        sm.forward(toks)
    cache.stack()

    # --- throughput -----------------------------------------------------------------------
    bs = batches(N)
    bare = {"wall": [], "cpu": []}
    rec = {"wall": [], "cpu": []}
    outs = []

    def run_bare(tk):
        with Clock() as c:
            sm.forward(tk)
        bare["wall"].append(c.wall)
        bare["cpu"].append(c.cpu)

    def run_rec(tk):
        with Clock() as c:
            with sm.record(names, positions="last", device="cpu") as cache:
                sm.forward(tk)
            out = cache.stack()  # [30, batch, 576]
        rec["wall"].append(c.wall)
        rec["cpu"].append(c.cpu)
        outs.append(out)

    for i, tk in enumerate(bs):
        if i % 2 == 0:
            run_bare(tk)
            run_rec(tk)
        else:
            run_rec(tk)
            run_bare(tk)
        print(f"  batch {i + 1}/{len(bs)} [{tuple(tk.input_ids.shape)}]: bare cpu {bare['cpu'][-1]:.2f} s, "
              f"record cpu {rec['cpu'][-1]:.2f} s", flush=True)
    allout = torch.cat(outs, 1)
    assert allout.shape == (sm.n_layers, N, sm.d_model), allout.shape
    other = "wall" if a.clock == "cpu" else "cpu"
    ratio = sum(bare[a.clock]) / sum(rec[a.clock])
    ratio_o = sum(bare[other]) / sum(rec[other])
    per_batch = C.median([b / r for b, r in zip(bare[a.clock], rec[a.clock])])
    rows = [[N, len(bs), f"{sum(bare[a.clock]):.1f}", f"{sum(rec[a.clock]):.1f}",
             f"{N / sum(bare[a.clock]):.1f}", f"{N / sum(rec[a.clock]):.1f}", ratio, per_batch, ratio_o]]
    print()
    print(C.table(["prompts", "batches", f"bare {a.clock} s", f"record {a.clock} s", "bare prompts/s",
                   "record prompts/s", "throughput ratio", "median per-batch ratio", f"ratio ({other})"], rows,
                  title="Record 30 x hook_resid_post, last token, vs bare forward (target ratio >= 0.9)"))
    print(f"throughput ratio {ratio:.3f} -> target >= 0.9: {'MET' if ratio >= 0.9 else 'NOT MET'}")
    mode = "quick" if a.quick else "full"
    out_csv = Path(a.out)
    thr = [{"mode": mode, "prompts": N, "batch": a.batch, "batches": len(bs), "clock": a.clock,
            "bare_s": round(sum(bare[a.clock]), 3), "record_s": round(sum(rec[a.clock]), 3),
            "bare_prompts_per_s": round(N / sum(bare[a.clock]), 2), "record_prompts_per_s": round(N / sum(rec[a.clock]), 2),
            "throughput_ratio": round(ratio, 4), "median_batch_ratio": round(per_batch, 4),
            "throughput_ratio_other_clock": round(ratio_o, 4), "threads": threads}]
    print(f"wrote {C.csv_rows(out_csv, thr)}")
    outs.clear()  # the recorded tensors are freed before the memory pass
    del allout
    bs_thr = bs

    if a.profile:  # a separate pass, so the profiler does not slow the timed one
        prof = cProfile.Profile()
        for tk in bs_thr[:4]:
            prof.enable()
            with sm.record(names, positions="last", device="cpu") as cache:
                sm.forward(tk)
            cache.stack()
            prof.disable()
        print()
        print(C.profile_report(prof, f"{min(4, len(bs_thr))} recorded batches"))

    # --- memory ---------------------------------------------------------------------------
    # For each N: a bare pass over the N prompts, then one record scope over the same N prompts,
    # each under an RSS sampler. The bare pass's peak is what the forward passes themselves need
    # (the logits [batch, pos, vocab] dominate); the record pass should need that plus its output.

    def trim() -> None:
        if a.malloc_trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)

    mrows, mem = [], []
    for n in mem_sizes:
        bs = batches(n)
        with RssPeak() as rb:
            for tk in bs:
                sm.forward(tk)
                trim()
        tracemalloc.start()
        with RssPeak() as rp:
            with sm.record(names, positions="last", device="cpu") as cache:
                for tk in bs:
                    sm.forward(tk)
                    trim()
            out = cache.stack()
        _, py_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out_mb = out.numel() * out.element_size() / 2**20
        assert out.shape == (sm.n_layers, n, sm.d_model)
        extra = (rp.peak - rb.peak) / 2**20
        mem.append({"mode": mode, "prompts": n, "batch": a.batch, "output_mib": round(out_mb, 2),
                    "bare_peak_rss_mib": round(rb.peak / 2**20, 1), "record_peak_rss_mib": round(rp.peak / 2**20, 1),
                    "record_minus_bare_mib": round(extra, 1),
                    "record_peak_minus_start_mib": round((rp.peak - rp.start) / 2**20, 1),
                    "tracemalloc_peak_mib": round(py_peak / 2**20, 3), "malloc_trim": a.malloc_trim})
        mrows.append([n, tuple(out.shape), f"{out_mb:.1f}", f"{rb.peak / 2**20:.0f}", f"{rp.peak / 2**20:.0f}",
                      f"{extra:+.0f}", f"{(rp.peak - rp.start) / 2**20:.0f}", f"{py_peak / 2**20:.2f}"])
        print(f"  memory runs at {n} prompts done", flush=True)
        del out, cache
    print()
    print(C.table(["prompts", "output shape", "output MiB", "bare peak RSS MiB", "record peak RSS MiB",
                   "record - bare MiB", "record peak - RSS before MiB", "tracemalloc peak MiB"], mrows,
                  title="Peak memory, one record scope over N prompts vs a bare pass over the same prompts "
                        "(flat = record - bare does not grow with N beyond the output)"))
    print(f"wrote {C.csv_rows(out_csv.with_name(out_csv.stem + '_memory.csv'), mem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
