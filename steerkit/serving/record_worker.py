"""Activation capture in the vLLM worker: the record operator, the forward hooks that call it, and the
per-step plan / collect / write that the plugin drives (:func:`on_load`, :func:`on_prepare`,
:func:`on_step_end`). The request's record spec is :mod:`steerkit.serving.record_spec`; the offline API
that reads the rows back is :mod:`steerkit.serving.capture`.

Forward hooks on the sites :func:`steerkit.loading.adapters.vllm_layout` names, after the steering hooks (so they see
steered values), each calling the recorder's own record operator (:class:`steerkit.serving.ops.ObjectOps`: a graph
traced by ``torch.compile`` keeps it and runs it at every step, on the host); an eager engine installs
them at its first recording step, a compiled one started with ``STEERKIT_VLLM_RECORD=1`` when it
loads (:func:`~steerkit.serving.record_spec.can_record`); per step :func:`on_prepare` plans the rows of
each recorded request (``query_start_loc``, positions, prompt length), the hooks copy those rows
to the CPU, and :func:`on_step_end` writes them as one safetensors file per run and step through
:class:`steerkit.storage.files.Folder` (confined to the record folder, written atomically) and forgets them:
nothing accumulates in the worker across steps. The plugin gives every recorded request its own
prefix-cache salt, so all of its prompt tokens are computed (and recorded), never read from cache.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import save
from torch import Tensor

from steerkit.bounded import BoundedDict
from steerkit.loading.adapters import vllm_sites
from steerkit.storage.files import Folder
from steerkit.interventions import server_mask_of

from steerkit.serving.ops import ObjectOps

from steerkit.serving.plan import runner_requests
from steerkit.serving.record_spec import ENV, KEY, RECORD_ENV, RecordSpec, can_record, parse_record
from steerkit.serving.spec import SpecError

log = logging.getLogger("steerkit.serving")

__all__ = ["StepRecorder", "RowBlock", "RecordWorker", "record_sites"]


def record_sites(model: Any) -> dict:
    """``{site: (module, kind)}`` the worker can record on this rank (module paths from
    :func:`steerkit.loading.adapters.vllm_layout`): "resid" for a decoder layer, "out" for a module whose
    output is the site (the sites a request can record; the read-only input sites of :func:`vllm_sites`,
    ``mlp.hook_in``, are not among them).

    Examples:
        >>> sites = record_sites(tiny.hf_model)
        >>> len(sites), sites["blocks.2.hook_resid_post"][1], sites["blocks.0.hook_resid_pre"][1]
        (13, 'resid', 'out')
    """
    return {site: mk for site, mk in vllm_sites(model).items() if mk[1] != "in"}


@dataclasses.dataclass
class RowBlock:
    """One recorded request's rows in a step: rows ``start:end`` of the flattened batch at absolute
    ``positions``, its prompt length and its :class:`RecordSpec`.

    Examples:
        >>> RowBlock(0, 3, np.arange(3), 3, parse_record({"hooks": ["blocks.0.hook_mlp_out"], "run": "r"})).end
        3
    """

    start: int
    end: int
    positions: np.ndarray
    n_prompt: int
    spec: RecordSpec


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


class StepRecorder:
    """The worker's recorder for one model: forward hooks on its sites (:func:`record_sites`) that copy
    the rows :meth:`plan` chose for this step to the CPU, and :meth:`collect`, which hands them out
    per run and forgets them.

    Examples:
        >>> rec = StepRecorder(tiny.hf_model)
        >>> spec = parse_record({"hooks": ["blocks.1.hook_mlp_out", "blocks.0.hook_resid_pre"],
        ...                      "positions": "last", "run": "r1", "request": "7"})
        >>> rec.plan([RowBlock(0, 5, np.arange(5), 5, spec)])
        >>> with rec:
        ...     _ = tiny.hf_model(torch.tensor([[1, 2, 3, 4, 5]]))
        >>> {k: tuple(v.shape) for k, v in rec.collect()["r1"].items()}
        {'7/positions': (1,), '7/blocks.1.hook_mlp_out': (1, 64), '7/blocks.0.hook_resid_pre': (1, 64)}
    """

    def __init__(self, model: Any):
        self.sites = record_sites(model)
        self._names = list(self.sites)
        self._token = torch.zeros(1)
        # the record operator of this recorder: a compiled graph keeps it (it "mutates" the token) and runs
        # its body, which copies the planned rows out, at every step
        self._ops = ObjectOps()
        self._op = self._ops.define("record_site_(Tensor x, Tensor? residual, Tensor(a!) token, int site) -> ()",
                                    lambda x, residual, token, site: self._record(self._names[site], x, residual))
        self.handles: list = []
        self._entries: list = []  # (spec, positions np) per recorded block with rows
        self._site_rows: dict = {}  # site -> (rows tensor, [(entry index, offset, n)])
        self._got: dict[str, Tensor] = {}
        self._device_rows: dict = {}

    # --- hooks --------------------------------------------------------------------------
    def install(self) -> "StepRecorder":
        """Register the forward hooks (after any hook already on the modules: recording sees their edits)."""
        if not self.handles:
            self.handles = [module.register_forward_hook(self._hook(site, kind))
                            for site, (module, kind) in self.sites.items()]
        return self

    def remove(self) -> None:
        """Remove the hooks (what they recorded stays until :meth:`collect` or :meth:`clear`)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "StepRecorder":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hook(self, site: str, kind: str):
        """The forward hook: the record operator on the module's output (``hidden, residual`` of a
        decoder layer), which runs :meth:`_record` at every step, traced or not."""
        i, op, token = self._names.index(site), self._op, self._token

        def hook(_mod, _args, output):
            if kind == "resid" and isinstance(output, tuple) and len(output) >= 2 and output[1] is not None \
                    and output[0].shape == output[1].shape:
                op(output[0], output[1], token, i)
            else:
                op(output[0] if isinstance(output, tuple) else output, None, token, i)
        return hook

    def _record(self, site: str, x: Tensor, residual: Optional[Tensor]) -> None:
        """Copy this step's planned rows of ``site`` (``x`` or ``x + residual``) to the CPU."""
        plan = self._site_rows.get(site)
        if plan is None:
            return
        try:
            rows = self._device_rows.get((site, x.device))
            if rows is None:
                rows = self._device_rows[(site, x.device)] = plan[0].to(x.device)
            v = _flat(x)[rows] if residual is None else _flat(x)[rows] + _flat(residual)[rows]
            self._got[site] = v.detach().to("cpu", torch.float32)
        except Exception:  # noqa: BLE001 - never take the engine down
            log.exception("steerkit: recording failed at %s; this step's rows there are skipped", site)

    # --- one step -----------------------------------------------------------------------
    def plan(self, blocks: Sequence[RowBlock]) -> None:
        """Choose this step's rows: each block's rows its positions select, for each site its hooks need."""
        self.clear()
        per_site: dict[str, list] = {}
        for b in blocks:
            if b.end <= b.start:
                continue
            pos = np.asarray(b.positions, dtype=np.int64)
            mask = server_mask_of(torch.from_numpy(pos), b.n_prompt)(b.spec.mask_spec())
            sel = np.arange(b.end - b.start) if mask is None else np.flatnonzero(mask.cpu().numpy())
            if sel.size == 0:
                continue
            e = len(self._entries)
            self._entries.append((b.spec, pos[sel]))
            for site in b.spec.sites():
                if site in self.sites:
                    per_site.setdefault(site, []).append((e, b.start + sel))
        for site, parts in per_site.items():
            rows = np.concatenate([r for _, r in parts])
            segs, off = [], 0
            for e, r in parts:
                segs.append((e, off, len(r)))
                off += len(r)
            self._site_rows[site] = (torch.from_numpy(rows), segs)

    def collect(self) -> dict[str, dict[str, Tensor]]:
        """This step's rows per run: ``{run: {"{request}/positions": [n], "{request}/{hook}": [n, d]}}``
        (float32, on the CPU); the plan and the rows are forgotten."""
        out: dict[str, dict[str, Tensor]] = {}
        for site, (_, segs) in self._site_rows.items():
            got = self._got.get(site)
            if got is None:
                continue
            for e, off, n in segs:
                spec, pos = self._entries[e]
                d = out.setdefault(spec.run, {})
                d.setdefault(f"{spec.request}/positions", torch.from_numpy(pos.copy()))
                for name in spec.sites()[site]:
                    d[f"{spec.request}/{name}"] = got[off:off + n].clone()  # one tensor per name: safetensors shares none
        self.clear()
        return out

    def clear(self) -> None:
        """Forget this step's plan and rows."""
        self._entries, self._site_rows, self._got, self._device_rows = [], {}, {}, {}



class RecordWorker:
    """A model runner's recording: its :class:`StepRecorder` (made at the first step that records in an eager
    engine, when the model loads in a compiled one), the record specs it has parsed (bounded) and the number of
    the next step file it writes. The plugin keeps one on each runner (``runner._steerkit_record``).

    Examples:
        >>> w = RecordWorker(tiny.hf_model, compiled=False)
        >>> w.spec('{"hooks": ["blocks.0.hook_mlp_out"], "run": "r"}').run, w.recorder is None
        ('r', True)
    """

    def __init__(self, model: Any, *, compiled: bool, max_specs: int = 256):
        self.model = model
        self.recorder: Optional[StepRecorder] = None
        self._specs: BoundedDict[str, Optional[RecordSpec]] = BoundedDict(max_specs)
        self._seq = itertools.count(1)
        if compiled:  # a compiled engine traces the model once: the hooks must be there before it does
            self.recorder = StepRecorder(model).install()
            log.info("steerkit: %d record hooks installed in pid %d (compiled)", len(self.recorder.handles),
                     os.getpid())

    def spec(self, raw: Any) -> Optional[RecordSpec]:
        """The :class:`RecordSpec` of a request's raw record spec (a JSON string or a dict); ``None`` for one
        that is not valid (the front end refuses those; a step never fails for it)."""
        text = raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True, default=str)
        if text not in self._specs:
            try:
                self._specs[text] = parse_record(text)
            except SpecError as e:
                log.error("steerkit: a request's record spec is not valid, it records nothing: %s", e)
                self._specs[text] = None
        return self._specs[text]

    def prepare(self, runner: Any) -> None:
        """After ``_prepare_inputs`` (the step's batch layout is final): plan the rows to record."""
        blocks = []
        for _, a, b, positions, n_prompt, raw in runner_requests(runner, KEY):
            spec = self.spec(raw)
            if spec is not None:
                blocks.append(RowBlock(a, b, positions, n_prompt, spec))
        if self.recorder is None:
            if not blocks:
                return
            self.recorder = StepRecorder(self.model).install()
            log.info("steerkit: %d record hooks installed in pid %d", len(self.recorder.handles), os.getpid())
        self.recorder.plan(blocks)

    def write(self) -> None:
        """After ``execute_model``: this step's rows into the record folder, one safetensors file per run, and
        forget them."""
        if self.recorder is None:
            return
        payloads = self.recorder.collect()
        if not payloads:
            return
        root = os.environ.get(ENV)
        if not root:
            log.error("steerkit: $%s is not set in the engine's process; this step's recorded rows are dropped", ENV)
            return
        folder = Folder(root)
        seq = next(self._seq)
        for run, tensors in payloads.items():
            folder.write_bytes(f"{run}/{seq:012d}-{os.getpid()}.safetensors", save(tensors))


def on_load(runner: Any) -> None:
    """Worker, after ``load_model`` and after the steering hooks (so recording sees steered values): the
    runner's :class:`RecordWorker`, or none where this engine cannot record (a compiled one started without
    ``STEERKIT_VLLM_RECORD=1``)."""
    runner._steerkit_record = None
    if not can_record(runner.model_config):
        log.info("steerkit: compiled engine without %s=1; record requests will be refused", RECORD_ENV)
        return
    runner._steerkit_record = RecordWorker(runner.model, compiled=not getattr(runner.model_config, "enforce_eager",
                                                                                False))


def on_prepare(runner: Any) -> None:
    """Worker, after ``_prepare_inputs``: plan the rows to record (:meth:`RecordWorker.prepare`)."""
    worker = getattr(runner, "_steerkit_record", None)
    if worker is None:
        return
    try:
        worker.prepare(runner)
    except Exception:  # noqa: BLE001 - never take the engine down
        log.exception("steerkit: could not plan this step's recording; it records nothing")
        if worker.recorder is not None:
            worker.recorder.clear()


def on_step_end(runner: Any) -> None:
    """Worker, after ``execute_model``: write this step's rows (:meth:`RecordWorker.write`)."""
    worker = getattr(runner, "_steerkit_record", None)
    if worker is None:
        return
    try:
        worker.write()
    except Exception:  # noqa: BLE001
        log.exception("steerkit: could not write this step's recorded rows")
        if worker.recorder is not None:
            worker.recorder.clear()
