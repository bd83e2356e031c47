"""GPU benchmark of the fused steering kernel (steerkit.kernels.fused_steer).

For each case it measures, side by side in one run:
  * the fused Triton kernel (impl="triton"),
  * a plain device copy of the same tensor (out.copy_(h)): the bandwidth ceiling,
  * the torch reference (impl="torch", what runs without Triton), and a naive
    eager torch chain (matmuls + adds + norms, no validation) for comparison,
and reports achieved bandwidth (bytes read + written / time), the fraction of the
copy's bandwidth, and the speed-up over both eager versions. It also checks the
kernel against the reference on every case and sweeps the launch parameters of
the headline case (4096 x 4096 bf16, ablation of 4 directions + one injection +
norm preservation; targets: >= 0.8 of copy bandwidth and >= 3x over eager torch).

Usage:  python benchmarks/gpu_kernels.py            # on a CUDA GPU, < 5 minutes
        python benchmarks/gpu_kernels.py --quick    # on a CUDA GPU, without the launch sweep
        TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --smoke   # CPU check of the script
Writes $OUT/gpu_kernels.json when OUT is set (or --json PATH), and the per-case rows to
``benchmarks/results/gpu_kernels.csv`` (``--out``; the sweep to ``gpu_kernels_sweep.csv`` next to
it). A ``--smoke`` run writes CSV only with an explicit ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _common as C  # noqa: E402  (standard library only)

import steerkit.kernels as K  # noqa: E402  (installed: scripts/gpu_check.sh installs it without dependencies)


def bench(fn, smoke: bool) -> float:
    """Median milliseconds per call."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))


def make_case(name, rows, d, dtype, device, *, k=0, inject=False, n_cfg=1, norm=False, region=False,
              gate=False, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(rows, d, generator=gen) * 3).to(device=device, dtype=dtype)
    kw = {}
    if k:
        kw["basis"] = K.orthonormalize(torch.randn(k, d, generator=gen, dtype=torch.float64)).float().to(device)
        kw["strength"] = torch.linspace(0.5, 1.0, k).to(device)
    if inject:
        kw["add"] = torch.randn(n_cfg, d, generator=gen).to(device)
        kw["scale"] = torch.linspace(0.5, 2.0, n_cfg).to(device)
    if n_cfg > 1:
        kw["row_config"] = (torch.arange(rows) % n_cfg).to(device)
    if gate:
        kw["gate_direction"] = torch.randn(d, generator=gen).to(device)
        kw["gate_threshold"] = 0.02
    if region:
        m, nh = 16, 16
        P = K.orthonormalize(torch.randn(m, d, generator=gen, dtype=torch.float64)).float()
        kw["region"] = K.Polyhedron(mean=torch.zeros(d), projection=P, normals=torch.randn(nh, m, generator=gen),
                                offsets=torch.rand(nh, generator=gen) * 2)
    rc = kw.get("row_config")
    tkw = {k_: v for k_, v in kw.items() if k_ != "row_config"}
    table = K.table_from_tensors(d, device, torch.float32, **tkw) if tkw else None
    return dict(name=name, h=h, table=table, row_config=rc, norm=norm, kw=kw)


def naive_eager(case):
    kw, h = case["kw"], case["h"]
    B, c, V, a = kw.get("basis"), kw.get("strength"), kw.get("add"), kw.get("scale")
    rc, norm = case["row_config"], case["norm"]

    def run():
        x = h.float()
        if B is not None:
            x = x - ((x @ B.T) * c) @ B
        if V is not None:
            x = x + (a[rc, None] * V[rc]) if rc is not None else x + a[0] * V[0]
        if norm:
            x = x * (h.float().norm(dim=-1, keepdim=True) / x.norm(dim=-1, keepdim=True))
        return x.to(h.dtype)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, CPU interpreter allowed")
    ap.add_argument("--quick", action="store_true", help="every case and the checks, without the launch sweep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None,
                    help="CSV of the per-case rows (default benchmarks/results/gpu_kernels.csv; none for --smoke "
                         "unless given); the sweep goes to <stem>_sweep.csv next to it")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    args.no_sweep = args.no_sweep or args.quick
    if args.out is None and not args.smoke:
        args.out = str(ROOT / "benchmarks" / "results" / "gpu_kernels.csv")
    smoke = args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (smoke and K.interpret_mode()):
        sys.exit("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    info = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                torch=torch.__version__)
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        pass
    print("device:", info)

    R, D = (64, 256) if smoke else (4096, 4096)
    RB = 256 if smoke else 32768  # larger-than-L2 case (32768 x 4096 bf16 = 256 MiB)
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    headline = "ablate4+inject+norm"
    specs = [
        (headline, R, D, bf16, dict(k=4, inject=True, norm=True)),
        (headline + " fp16", R, D, f16, dict(k=4, inject=True, norm=True)),
        (headline + " fp32", R, D, f32, dict(k=4, inject=True, norm=True)),
        (headline + " big", RB, D, bf16, dict(k=4, inject=True, norm=True)),
        ("ablate4", R, D, bf16, dict(k=4)),
        ("ablate16", R, D, bf16, dict(k=16)),
        ("inject", R, D, bf16, dict(inject=True)),
        ("inject 8 cfgs/row", R, D, bf16, dict(inject=True, n_cfg=8)),
        ("ablate4+gated inject+norm", R, D, bf16, dict(k=4, inject=True, gate=True, norm=True)),
        ("region m16 nh16", R, D, bf16, dict(region=True)),
    ]
    results = []
    hdr = f"{'case':34s} {'rows x d':>12s} {'dtype':>8s} {'fused ms':>9s} {'copy ms':>8s} {'GB/s':>7s} " \
          f"{'frac copy':>9s} {'ref ms':>8s} {'x ref':>6s} {'naive ms':>8s} {'x naive':>7s} {'max err':>9s}"
    print(hdr)
    for name, rows, d, dt, opts in specs:
        try:
            run_case(name, rows, d, dt, opts, device, smoke, results)
        except Exception as e:  # report and go on: one broken case must not lose the others
            print(f"{name:34s} FAILED {type(e).__name__}: {str(e)[:300]}")
            results.append(dict(case=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        if device == "cuda":
            torch.cuda.empty_cache()
    _sweep_and_rest(args, smoke, device, R, D, bf16, headline, results, info)


def run_case(name, rows, d, dt, opts, device, smoke, results):
    case = make_case(name, rows, d, dt, device, **opts)
    h, tab, rc, norm = case["h"], case["table"], case["row_config"], case["norm"]

    def fused(impl):
        return lambda: K.fused_steer(h, tab, row_config=rc, preserve_norm=norm, impl=impl, validate=False)

    out_t = fused("triton")()
    out_r = fused("torch")()
    err = (out_t.float() - out_r.float()).abs().max().item()
    scale_ = out_r.float().abs().max().item()
    buf = torch.empty_like(h)
    t_fused = bench(fused("triton"), smoke)
    t_copy = bench(lambda: buf.copy_(h), smoke)
    t_ref = bench(fused("torch"), smoke)
    t_naive = bench(naive_eager(case), smoke) if not opts.get("region") and not opts.get("gate") else float("nan")
    nbytes = 2 * h.numel() * h.element_size()
    row = dict(case=name, rows=rows, d_model=d, dtype=str(dt).replace("torch.", ""), fused_ms=t_fused,
               copy_ms=t_copy, fused_GBps=nbytes / t_fused / 1e6, copy_GBps=nbytes / t_copy / 1e6,
               frac_of_copy=t_copy / t_fused, ref_ms=t_ref, speedup_vs_ref=t_ref / t_fused,
               naive_ms=t_naive, speedup_vs_naive=t_naive / t_fused, max_abs_err=err, ref_max_abs=scale_)
    results.append(row)
    print(f"{name:34s} {rows:>5d} x {d:<5d} {row['dtype']:>8s} {t_fused:9.4f} {t_copy:8.4f} "
          f"{row['fused_GBps']:7.0f} {row['frac_of_copy']:9.2f} {t_ref:8.4f} {row['speedup_vs_ref']:6.1f} "
          f"{t_naive:8.4f} {row['speedup_vs_naive']:7.1f} {err:9.2e}")
    del case, out_t, out_r


def _sweep_one(label, case, smoke, grid, sweep, extra=None):
    """Time the case for each (block_r, block_d, num_warps) in grid; append rows to sweep."""
    h, tab, rc, norm = case["h"], case["table"], case["row_config"], case["norm"]
    buf = torch.empty_like(h)
    t_copy = bench(lambda: buf.copy_(h), smoke)
    print(f"\nlaunch sweep, {label} {tuple(h.shape)} {str(h.dtype)[6:]} (copy {t_copy:.4f} ms)")
    for br, bd, nw in grid:
        launch = K.LaunchParams(block_d=bd, block_r=br, num_warps=nw, **(extra or {}))
        try:
            t = bench(functools.partial(K.fused_steer, h, tab, row_config=rc, preserve_norm=norm, impl="triton",
                                        validate=False, launch=launch), smoke)
            sweep.append(dict(case=label, block_r=br, block_d=bd, num_warps=nw, ms=t, frac_of_copy=t_copy / t,
                              **(extra or {})))
            print(f"  block_r={br:2d} block_d={bd:4d} num_warps={nw:2d} {extra or ''}: {t:.4f} ms  "
                  f"frac of copy {t_copy / t:.2f}", flush=True)
        except Exception as e:  # a launch that does not fit (registers) is reported, not fatal
            print(f"  block_r={br:2d} block_d={bd:4d} num_warps={nw:2d}: failed {type(e).__name__}: {str(e)[:80]}")


def gpu_check(device, smoke):
    """Kernel vs reference on ragged shapes (several d chunks, partial row tiles), every pass."""
    gen = torch.Generator().manual_seed(1)
    tols = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 2 * 2.0**-8), torch.float16: (2e-3, 2 * 2.0**-11)}
    worst = []
    shapes = [(37, 200, torch.float32)] if smoke else [
        (1000, 1000, torch.float32), (1000, 1000, torch.bfloat16), (4099, 4096, torch.bfloat16), (3, 5120, torch.float16)]
    for rows, d, dt in shapes:
        h = (torch.randn(rows, d, generator=gen) * 3).to(device=device, dtype=dt)
        B = torch.stack([K.orthonormalize(torch.randn(4, d, generator=gen, dtype=torch.float64))
                         for _ in range(3)]).float().to(device)
        rc = torch.randint(0, 3, (rows,), generator=gen).to(device)
        msk = (torch.rand(rows, generator=gen) > 0.2).to(device)
        V = torch.randn(3, d, generator=gen).to(device)
        u = torch.randn(d, generator=gen).to(device)
        kws = {
            "headline": dict(basis=B[0], strength=torch.linspace(0.5, 1, 4).to(device), add=V[0], scale=1.5),
            "ablate16": dict(basis=K.orthonormalize(torch.randn(16, d, generator=gen, dtype=torch.float64))
                             .float().to(device), strength=0.9),
            "inject": dict(add=V[0], scale=0.7),
            "per-row all": dict(basis=B, strength=1.0, target=torch.tensor([0., 1., -1., 2.]).to(device),
                                add=V, scale=torch.tensor([0.5, 1., 2.]).to(device), row_config=rc,
                                mask=msk, gate_direction=u, gate_threshold=0.02),
        }
        for name, kw in kws.items():
            for pn in (True, False):
                o_t = K.fused_steer(h, **kw, preserve_norm=pn, impl="triton")
                o_r = K.fused_steer(h, **kw, preserve_norm=pn, impl="torch")
                atol, rtol = tols[dt]
                excess = ((o_t.float() - o_r.float()).abs() - (atol + rtol * o_r.float().abs())).max().item()
                worst.append(dict(rows=rows, d=d, dtype=str(dt)[6:], case=name, norm=pn, excess=excess,
                                  ok=excess <= 0))
    bad = [w for w in worst if not w["ok"]]
    print(f"\ngpu check: {len(worst) - len(bad)}/{len(worst)} within the test tolerances"
          + ("" if not bad else f"; FAILED: {bad[:6]}"))
    return dict(n=len(worst), failed=bad)


def _sweep_and_rest(args, smoke, device, R, D, bf16, headline, results, info):
    check = gpu_check(device, smoke)
    sweep = []
    if not args.no_sweep:
        g3 = [(br, bd, nw) for br in (8, 16, 32) for bd in (128, 256, 512) for nw in (4, 8)]
        if smoke:
            g3 = [(8, 64, 4), (16, 128, 4)]
        case = make_case(headline, R, D, bf16, device, k=4, inject=True, norm=True)
        _sweep_one(headline, case, smoke, g3, sweep)
        _sweep_one(headline + " exact norm pass", case, smoke, g3[::3], sweep, dict(norm_fast=False))
        del case
        big = make_case(headline + " big", 32768 if not smoke else 256, D, bf16, device, k=4, inject=True,
                        norm=True)
        _sweep_one(headline + " big", big, smoke, g3, sweep)
        del big
        g16 = [(br, bd, nw) for br in (16, 32) for bd in (128, 256) for nw in (4, 8)]
        ginj = [(br, bd, 4) for br in (8, 16, 32) for bd in (256, 512)] + [(16, 512, 8)]
        for nm, opts, gr in (("ablate16", dict(k=16), g16), ("inject", dict(inject=True), ginj)):
            c_ = make_case(nm, R, D, bf16, device, **opts)
            _sweep_one(nm, c_, smoke, gr if not smoke else g3, sweep)
            del c_

    # backward check (ablation + injection, analytic) on the device
    case = make_case("bwd", 512 if not smoke else 16, D, torch.float32, device, k=4, inject=True, n_cfg=2)
    kw = {k_: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k_, v in case["kw"].items()}
    hh = case["h"].clone().requires_grad_()
    outs = {}
    for impl in ("triton", "torch"):
        leaves = [hh, kw["basis"], kw["add"]]
        o = K.fused_steer(hh, basis=kw["basis"], strength=kw["strength"], add=kw["add"], scale=kw["scale"],
                          row_config=kw["row_config"], impl=impl)
        outs[impl] = torch.autograd.grad(o, leaves, torch.ones_like(o))
    bwd_err = max((a - b).abs().max().item() for a, b in zip(outs["triton"], outs["torch"]))
    print(f"\nbackward (ablation+injection) max |triton - torch| over dh, dB, dV: {bwd_err:.2e}")

    head = results[0] if "error" not in results[0] else {}
    summary = dict(headline=headline, frac_of_copy=head.get("frac_of_copy"), target_frac=0.8,
                   speedup_vs_ref=head.get("speedup_vs_ref"), speedup_vs_naive=head.get("speedup_vs_naive"),
                   target_speedup=3.0,
                   best_sweep={c: max((s for s in sweep if s["case"] == c), key=lambda s: s["frac_of_copy"])
                               for c in dict.fromkeys(s["case"] for s in sweep)})
    print("\nsummary:", json.dumps(summary))
    payload = dict(info=info, results=results, sweep=sweep, backward_max_err=bwd_err, summary=summary, check=check,
                   smoke=smoke)
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_kernels.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        print("wrote", path)
    if args.out:
        mode = "smoke" if smoke else "quick" if args.quick else "full"
        dev = {"mode": mode, "device": info["device"], "triton": info.get("triton", "")}
        out = Path(args.out)
        print("wrote", C.csv_rows(out, [{**dev, **r} for r in results]))
        if sweep:
            print("wrote", C.csv_rows(out.with_name(out.stem + "_sweep.csv"), [{**dev, **r} for r in sweep]))


if __name__ == "__main__":
    main()
