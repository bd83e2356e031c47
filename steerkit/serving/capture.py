"""Activation capture through vLLM, the offline API: :func:`record_generate` sends requests with record
specs and returns the recorded rows with the outputs; :func:`record_dataset_vllm` writes a data set.

The pieces it stands on, each in its own module (their names are importable from here too):

* :mod:`steerkit.serving.record_spec`: a request's record spec (``extra_args["steerkit_record"]``:
  hooks, positions, run and request), :func:`parse_record`, :func:`record_args`, the front end's
  :func:`check_request`;
* :mod:`steerkit.serving.record_worker`: the worker's record operator, forward hooks and per-step
  collection (:class:`StepRecorder`), which write each step's rows to ``$STEERKIT_RECORD_DIR``.

Recording happens after steering at the same site, so a steered request records what a steered
``sm.record`` records. "generated" rows are those of the generated tokens the model ran on: a
request with ``max_tokens=N`` runs on ``N - 1`` of its generated tokens (the last one is sampled,
never fed back).

:func:`record_generate` runs ``LLM.generate`` with record specs and returns, per request, its rows
``{hook: [n_positions, d_model]}`` (float32); :func:`record_dataset_vllm` writes the sharded,
resumable data set of :func:`steerkit.recording.record_dataset` through vLLM (``steerkit record
--engine vllm``, which runs :func:`main` in vLLM's Python).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from jaxtyping import Float
from safetensors.torch import load
from torch import Tensor

from steerkit.executors import LocalExecutor, RayExecutor
from steerkit.storage.dataset import FORMAT, ActivationDataset, _prompts_hash, resume_state, write_shards
from steerkit.errors import BackendUnavailableError, InputError, SteerkitError
from steerkit.storage.files import Folder
from steerkit.loading.fingerprint import folder_fingerprint
from steerkit.interventions import server_mask_of

from steerkit.serving.record_spec import (ENV, KEY, MAX_HOOKS as MAX_HOOKS, MAX_INDICES as MAX_INDICES,
                          MAX_SPEC_CHARS as MAX_SPEC_CHARS, RECORD_ENV, RecordSpec, _n_layers, can_record,
                          check_request, parse_record, record_args, record_site)
from steerkit.serving.record_worker import (RowBlock, StepRecorder, on_load as on_load, on_prepare as on_prepare,
                            on_step_end as on_step_end, record_sites as record_sites)

log = logging.getLogger("steerkit.serving")

__all__ = ["KEY", "ENV", "RECORD_ENV", "RecordSpec", "parse_record", "record_args", "check_request", "can_record",
           "StepRecorder",
           "RowBlock", "start_llm", "record_generate", "record_shard_vllm", "record_dataset_vllm", "VllmSpec",
           "dataset_plan", "main"]

#: the largest record file the reader accepts
MAX_FILE_BYTES = 1 << 34


# ------------------------------------------------------------------------------ offline API
def _plugin_on() -> bool:
    names = [n.strip() for n in os.environ.get("VLLM_PLUGINS", "").split(",")]
    return "steerkit" in names or os.environ.get("STEERKIT_VLLM") == "1"


def start_llm(model: str, *, record_dir: Optional[str] = None, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` that can record (eager, the steerkit plugin on, ``$STEERKIT_RECORD_DIR`` set
    before the engine starts, which a multiprocess engine needs); ``kwargs`` go to ``LLM``.

    Examples:
        >>> llm = start_llm("path/to/exported-model", dtype="float32")  # doctest: +SKIP
        >>> outputs, rows = record_generate(llm, ["Hi"], hooks=["blocks.3.hook_resid_post"])  # doctest: +SKIP

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    if not _plugin_on():
        os.environ["VLLM_PLUGINS"] = ",".join([p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
                                              + ["steerkit"])
    if record_dir is not None:
        os.environ[ENV] = str(Path(record_dir).resolve())
    elif not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="steerkit-record-")
    from vllm import LLM
    kwargs.setdefault("enforce_eager", True)
    return LLM(model=model, **kwargs)


def _model_config(llm: Any) -> Any:
    cfg = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    if cfg is None:
        cfg = llm.llm_engine.vllm_config.model_config
    return cfg


def _read_run(folder: Folder, run: str) -> dict[str, dict[str, dict[int, Tensor]]]:
    """``{request: {hook: {position: row}}}`` from a run's files (a later file wins: a recomputed
    token after a preemption writes the same row again)."""
    out: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name in folder.listdir(run):
        if not name.endswith(".safetensors") or name.startswith("."):
            continue
        tensors = load(folder.read_bytes(f"{run}/{name}", MAX_FILE_BYTES))
        for key, t in tensors.items():
            req, _, hook = key.partition("/")
            if hook == "positions":
                continue
            pos = tensors[f"{req}/positions"].tolist()
            d = out.setdefault(req, {}).setdefault(hook, {})
            for p, row in zip(pos, t):
                d[int(p)] = row
    return out


def _as_params(sampling_params: Any, n: int) -> list:
    from vllm import SamplingParams
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    sps = list(sampling_params)
    if len(sps) != n:
        raise InputError(f"expected one SamplingParams per prompt ({n}), found {len(sps)}; pass one for all or "
                         "a list as long as the prompts")
    return sps


def record_generate(llm: Any, prompts: Sequence[Any], sampling_params: Any = None, *,
                    hooks: Union[str, Sequence[str]], positions: Union[str, Sequence[int]] = "all",
                    record: Optional[Sequence[Any]] = None, use_tqdm: bool = True
                    ) -> tuple[list, list[Optional[dict[str, Float[Tensor, "n_positions d_model"]]]]]:
    """``llm.generate(prompts, sampling_params)`` recording ``hooks`` at ``positions`` through vLLM's
    continuous batching; returns ``(outputs, rows)`` where ``rows[i]`` is ``{hook: [n_positions,
    d_model]}`` (float32, positions in order) for each recorded request and ``None`` for the others.

    ``record``: which requests record (default: all): per prompt ``True`` (``hooks`` at
    ``positions``), a ``{"hooks": ..., "positions": ...}`` dict of its own, or ``False`` / ``None``.
    Requests may also steer (``extra_args`` from :func:`steerkit.serving.request_args`): they record
    the steered values. Prompts and sampling parameters are those of ``LLM.generate``; a recorded
    request needs ``n=1``. The engine must run the steerkit plugin in eager mode with
    ``$STEERKIT_RECORD_DIR`` set before it started when it is multiprocess (:func:`start_llm`); the
    rows are read back from that folder and removed.

    Examples:
        >>> outputs, rows = record_generate(llm, ["Hello"], hooks=["blocks.3.hook_resid_post"],
        ...                                 positions="last")  # doctest: +SKIP
        >>> rows[0]["blocks.3.hook_resid_post"].shape  # doctest: +SKIP
        torch.Size([1, 576])

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to generate from, found an empty list")
    if not _plugin_on():
        raise BackendUnavailableError("expected the steerkit vLLM plugin enabled (VLLM_PLUGINS=steerkit, set before "
                                      "vLLM starts), found it off; start the engine with "
                                      "steerkit.serving.capture.start_llm(...) or set VLLM_PLUGINS=steerkit")
    cfg = _model_config(llm)
    n_layers, d_model = _n_layers(cfg), int(cfg.get_hidden_size())
    flags = [True] * len(prompts) if record is None else list(record)
    if len(flags) != len(prompts):
        raise InputError(f"expected record= with one entry per prompt ({len(prompts)}), found {len(flags)}")
    params = _as_params(sampling_params, len(prompts))
    root = os.environ.get(ENV)
    if not root:
        root = os.environ[ENV] = tempfile.mkdtemp(prefix="steerkit-record-")
    folder = Folder(root)
    run = uuid.uuid4().hex[:16]
    wanted: dict[int, RecordSpec] = {}
    sent = []
    for i, (flag, sp) in enumerate(zip(flags, params)):
        if not flag:
            sent.append(sp)
            continue
        h, p = (flag.get("hooks", hooks), flag.get("positions", positions)) if isinstance(flag, dict) else \
            (hooks, positions)
        if getattr(sp, "n", 1) != 1:
            raise InputError(f"expected n=1 for a recorded request, found n={sp.n} for prompt {i}; send each "
                             "sample as its own request")
        xa = record_args(h, p, run=run, request=i)
        wanted[i] = parse_record(xa[KEY], n_layers)
        sp = sp.clone()
        sp.extra_args = {**(sp.extra_args or {}), **xa}
        sent.append(sp)
    try:
        outputs = llm.generate(prompts, sent, use_tqdm=use_tqdm)
        got = _read_run(folder, run) if wanted else {}
    finally:
        if wanted:
            folder.remove(run)
    rows: list[Optional[dict[str, Tensor]]] = [None] * len(prompts)
    for i, spec in wanted.items():
        o = outputs[i]
        n_prompt = len(o.prompt_token_ids or [])
        n_fed = n_prompt + max(len(o.outputs[0].token_ids) - 1, 0) if o.outputs else n_prompt
        per = got.get(str(i), {})
        mine: dict[str, Tensor] = {}
        for h in spec.hooks:
            d = {p: r for p, r in per.get(h, {}).items() if p < n_fed}
            mine[h] = torch.stack([d[p] for p in sorted(d)]) if d else torch.zeros(0, d_model)
        rows[i] = mine
        expect = server_mask_of(torch.arange(n_fed), n_prompt)(spec.mask_spec()) if n_fed else None
        n_expect = n_fed if expect is None else int(expect.sum())
        if n_expect and not got:
            raise SteerkitError(f"expected the recorded rows of run {run} in {root}, found none: a multiprocess "
                                f"engine reads ${ENV} when it starts (start it with "
                                "steerkit.serving.capture.start_llm(...) or set the variable before LLM(...)), and "
                                "the engine's log says why when it could not write them")
    return outputs, rows


# ------------------------------------------------------------------------------ data set
def _format_prompt(tok: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt`` as :meth:`steerkit.SteerModel.tokenize` makes them."""
    templ = chat and getattr(tok, "chat_template", None)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=False) if templ else prompt
    return list(tok(text, add_special_tokens=not templ)["input_ids"])


def _position_spec(positions: Any) -> Any:
    return positions if isinstance(positions, (str, int)) else list(positions)


def _model_meta(model_dir: str) -> tuple[str, Optional[str], int, int]:
    """(name, fingerprint, n_layers, d_model) of a Hugging Face model folder."""
    p = Path(model_dir)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"expected a Hugging Face model folder with config.json at {model_dir}, could not read it "
                         f"({e}); write one with: steerkit model export --format hf DIR") from None
    text = cfg.get("text_config") or cfg
    try:
        fp: Optional[str] = folder_fingerprint(p)
    except Exception as e:  # noqa: BLE001 - no safetensors, unreadable config: recorded without one
        log.warning("steerkit: no fingerprint for %s (%s)", model_dir, e)
        fp = None
    name = str(p)
    try:  # a steerkit export names the model it was written from
        name = str(json.loads((p / "steerkit_export.json").read_text()).get("name") or name)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return name, fp, int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"expected num_hidden_layers and hidden_size in {p / 'config.json'}, found neither; "
                         "is it a decoder language model?") from None


def dataset_plan(model_dir: str, prompts: Sequence[str], hooks: Sequence[str], out_dir: Any, *,
                 positions: Any = "last", shard_size: int = 256, chat: bool = False) -> tuple[dict, list[int]]:
    """The manifest fields of a recording of ``prompts`` into ``out_dir`` (the format of
    :func:`steerkit.recording.record_dataset`) and the shards still to record (resuming a folder of
    the same run; another run there is an error). Needs no vLLM.

    Examples:
        >>> from steerkit.loading.export_hf import export_hf
        >>> folder = export_hf(tiny, tmp_dir / "tiny")
        >>> meta, todo = dataset_plan(str(folder), ["a", "b", "c"], ["blocks.1.hook_resid_post"], tmp_dir / "ds",
        ...                           shard_size=2)
        >>> meta["format"], meta["n_prompts"], todo
        ('steerkit.activations/1', 3, [0, 1])
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to record, found an empty list")
    if shard_size < 1:
        raise InputError(f"expected shard_size >= 1, found {shard_size}")
    name, fp, n_layers, d_model = _model_meta(model_dir)
    for h in hooks:
        record_site(h, n_layers)
    parse_record({"hooks": list(hooks), "positions": _position_spec(positions), "run": "check"})
    meta = {"format": FORMAT, "hooks": list(hooks), "positions": _position_spec(positions), "model": name,
            "fingerprint": fp, "n_prompts": len(prompts), "prompts_sha256": _prompts_hash(prompts),
            "shard_size": shard_size, "chat": chat, "d_model": d_model}
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"expected the output folder {out} to be a folder or not exist yet, found a file; "
                         "choose another path or remove the file")
    done, todo = resume_state(out, meta, len(prompts), shard_size)
    meta["shards"] = done
    return meta, todo


@dataclasses.dataclass(frozen=True)
class VllmSpec:
    """What each Ray worker of a vLLM recording loads once (a :class:`steerkit.executors.WorkerSpec`): a
    vLLM engine that records (:func:`start_llm`, into a spool folder of its own) serving ``model``, a
    Hugging Face folder every node reads at the same path; ``engine``: ``vllm.LLM`` arguments (default
    float32, seed 0, eager); ``threads``: OpenMP threads of a CPU engine, not bound to cores, so several
    engines on one machine share its cores as Ray shares its CPUs (``None``: vLLM's own binding).

    Examples:
        >>> VllmSpec("model-dir", {"max_num_batched_tokens": 2048}, threads=1).engine_kwargs()
        {'dtype': 'float32', 'seed': 0, 'max_num_batched_tokens': 2048}
    """
    model: str
    engine: dict = dataclasses.field(default_factory=dict)
    threads: Optional[int] = None

    def engine_kwargs(self) -> dict:
        return {"dtype": "float32", "seed": 0, **self.engine}

    def load(self) -> Any:
        """The engine, started here (what each worker does once)."""
        if self.threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            torch.set_num_threads(self.threads)
        return start_llm(self.model, record_dir=tempfile.mkdtemp(prefix="steerkit-record-"), **self.engine_kwargs())

    def fingerprint(self, llm: Any) -> str:
        """What must be equal on every worker: the fingerprint of the model folder it serves."""
        return str(_model_meta(self.model)[1])


def record_shard_vllm(llm: Any, chunk: Sequence[str], *, hooks: Sequence[str], positions: Any = "last",
                      batch_size: int = 64, chat: bool = False,
                      on_batch: Optional[Any] = None) -> dict[str, Tensor]:
    """One shard's tensors recorded through ``llm``: each prompt runs its prompt tokens once
    (``max_tokens=1``), ``batch_size`` requests per ``generate`` call; a tensor per hook (float32, on the
    CPU) and its ``::lengths`` where positions vary (the layout of
    :func:`steerkit.recording.record_shard`); ``on_batch(n)`` after each batch of ``n`` prompts.

    Examples:
        >>> shard = record_shard_vllm(llm, ["Hi", "Bye"], hooks=["blocks.3.hook_resid_post"])  # doctest: +SKIP
        >>> shard["blocks.3.hook_resid_post"].shape  # doctest: +SKIP
        torch.Size([2, 576])

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    from vllm import SamplingParams
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    tensors: dict[str, list[Tensor]] = {h: [] for h in hooks}
    lengths: dict[str, list[int]] = {h: [] for h in hooks}
    for j in range(0, len(chunk), batch_size):
        part = chunk[j:j + batch_size]
        ids = [{"prompt_token_ids": _format_prompt(tok, p, chat)} for p in part]
        _, rows = record_generate(llm, ids, sp, hooks=list(hooks), positions=_position_spec(positions),
                                  use_tqdm=False)
        for r in rows:
            assert r is not None
            for h in hooks:
                tensors[h].append(r[h])
                lengths[h].append(int(r[h].shape[0]))
        if on_batch is not None:
            on_batch(len(part))
    last = positions == "last"
    if last:
        bad = sorted({n for h in hooks for n in lengths[h] if n != 1})
        if bad:
            raise InputError(f"expected one last-prompt-token row per prompt, found counts {bad}")
    payload = {h: torch.cat(tensors[h]).contiguous() for h in hooks}
    if not last:
        payload.update({f"{h}::lengths": torch.tensor(lengths[h], dtype=torch.long) for h in hooks})
    return payload


def _shard_task(llm: Any, item: tuple[int, list[str]], **options: Any) -> tuple[int, dict[str, Tensor]]:
    i, chunk = item
    return i, record_shard_vllm(llm, chunk, **options)


def record_dataset_vllm(llm: Any, model_dir: str, prompts: Sequence[str], hooks: Sequence[str], out_dir: Any, *,
                        positions: Any = "last", batch_size: int = 64, shard_size: int = 256, chat: bool = False,
                        progress: bool = True, executor: Optional[RayExecutor] = None) -> ActivationDataset:
    """Record ``hooks`` at ``positions`` for every prompt through vLLM (``llm`` serves ``model_dir``)
    into the sharded, resumable folder :func:`steerkit.recording.record_dataset` writes (the same
    manifest, shards and ``::lengths``, float32), shard by shard with :func:`record_shard_vllm`. Prompts
    are tokenized as :meth:`steerkit.SteerModel.tokenize` does: raw text by default, the chat template
    when ``chat``. ``executor``: a :class:`steerkit.executors.RayExecutor` of :class:`VllmSpec` workers
    (``llm`` may then be ``None``) records the shards on Ray workers, each with its own engine; this
    process writes every shard and the manifest (:func:`steerkit.storage.dataset.write_shards`).

    Examples:
        >>> ds = record_dataset_vllm(llm, "model-dir", ["Hi", "Bye"], ["blocks.3.hook_resid_post"],
        ...                          "acts")  # doctest: +SKIP
        >>> ds.load("blocks.3.hook_resid_post").shape  # doctest: +SKIP
        torch.Size([2, 576])

    (skipped: it needs vLLM, which lives in its own environment.)
    """
    if batch_size < 1:
        raise InputError(f"expected batch_size >= 1, found {batch_size}")
    prompts, hooks = list(prompts), list(hooks)
    meta, _ = dataset_plan(model_dir, prompts, hooks, out_dir, positions=positions, shard_size=shard_size, chat=chat)
    meta.pop("shards")
    if executor is None and llm is None:
        raise InputError("expected an engine to record with, found neither llm nor executor=; pass a started "
                         "vllm.LLM (start_llm) or a steerkit.executors.RayExecutor of VllmSpec workers")
    ex = executor if executor is not None else LocalExecutor(llm)
    task = functools.partial(_shard_task, hooks=hooks, positions=positions, batch_size=batch_size, chat=chat)
    return write_shards(ex, task, meta, prompts, Path(out_dir), progress=progress, desc="recording (vLLM)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``steerkit record --engine vllm`` inside vLLM's Python: ``main([JOB.json])`` reads the job the
    CLI wrote (model, prompts, hooks, positions, out, shard_size, batch_size, chat, engine, progress, and
    ``ray``: ``{"address", "workers", "cpus_per_worker", "gpus_per_worker", "threads"}`` to record on Ray
    workers), starts the engine (:func:`start_llm`) or the workers (:class:`VllmSpec`) and runs
    :func:`record_dataset_vllm`.

    Examples:
        >>> main([str(tmp_dir / "missing.json")])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected the record job file ... could not read it ...
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise InputError(f"expected one argument, the record job file, found {len(args)}")
    try:
        job = json.loads(Path(args[0]).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"expected the record job file {args[0]} as JSON, could not read it ({e})") from None
    options = {"positions": job.get("positions", "last"), "batch_size": int(job.get("batch_size", 64)),
               "shard_size": int(job.get("shard_size", 256)), "chat": bool(job.get("chat", True)),
               "progress": bool(job.get("progress", True))}
    ray = job.get("ray")
    if ray:  # the shards on Ray workers, each with an engine of its own; this process writes them
        spec = VllmSpec(job["model"], dict(job.get("engine") or {}), threads=ray.get("threads"))
        with RayExecutor(spec, workers=int(ray["workers"]), address=ray.get("address"),
                         cpus_per_worker=float(ray.get("cpus_per_worker", 1)),
                         gpus_per_worker=float(ray.get("gpus_per_worker", 0))) as ex:
            record_dataset_vllm(None, job["model"], job["prompts"], job["hooks"], job["out"], executor=ex, **options)
        return 0
    llm = start_llm(job["model"], **VllmSpec(job["model"], dict(job.get("engine") or {})).engine_kwargs())
    record_dataset_vllm(llm, job["model"], job["prompts"], job["hooks"], job["out"], **options)
    return 0


