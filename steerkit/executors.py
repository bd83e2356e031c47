"""Where independent pieces of work run: in this process on its model, or on Ray workers that each load the
model once.

An executor maps a function ``fn(sm, item)`` over items and yields ``(index, result)`` as results arrive.
:class:`LocalExecutor` runs them here, in order, on a model already loaded. :class:`RayExecutor` starts
``workers`` Ray actors (on a running cluster at ``address``, or a local one ``ray.init`` starts), each loading
the model described by a :class:`ModelSpec` once, and sends each item to an idle one. A worker that dies
(killed, out of memory, its node lost) loses only the item it was running: the item goes back to the
queue, and a new worker replaces the dead one (at most ``replacements`` times in all). Results travel back
through Ray's object store; whatever is written to disk is written by the caller in this process, so a
result counts once however many times its item ran. An error raised by ``fn`` itself is raised here as the
worker raised it (a :class:`~steerkit.errors.SteerkitError` stays one).

Ray is an optional extra (``pip install steerkit[ray]``) and is imported only when a :class:`RayExecutor`
starts.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import uuid
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch

from steerkit.errors import BackendUnavailableError, InputError
from steerkit.model import SteerModel, load_model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a worker loads: the arguments of :func:`steerkit.load_model` (``model`` a folder, ``.gguf`` file,
    Hub id or ``None`` for the embedded default; ``device`` / ``dtype`` as there, resolved on the worker,
    so ``"auto"`` takes the worker's GPU), and ``threads`` torch threads on a CPU worker (``None``: torch's
    default for the CPUs Ray gives it).

    Examples:
        >>> ModelSpec().load_kwargs()
        {'device': 'cpu', 'dtype': 'auto', 'backend': 'hf'}
        >>> ModelSpec("org/name", device="auto", dtype="bfloat16").model
        'org/name'
    """
    model: Optional[str] = None
    device: str = "cpu"
    dtype: str = "auto"
    backend: str = "hf"
    threads: Optional[int] = None

    def load_kwargs(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "backend": self.backend}

    def load(self) -> SteerModel:
        """The model, loaded here (what each worker does once)."""
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return load_model(self.model, **self.load_kwargs())

    def fingerprint(self, sm: SteerModel) -> str:
        """What must be equal on every worker: the loaded model's fingerprint."""
        return sm.fingerprint()


@runtime_checkable
class WorkerSpec(Protocol):
    """What a Ray worker loads once and how its workers are checked to agree: :class:`ModelSpec` (a
    :class:`~steerkit.SteerModel`) or :class:`steerkit.serving.capture.VllmSpec` (a vLLM engine that records).

    Examples:
        >>> isinstance(ModelSpec(), WorkerSpec)
        True
    """

    def load(self) -> Any: ...

    def fingerprint(self, state: Any) -> str: ...



class LocalExecutor:
    """Runs every item here, in order, on ``state``: a loaded :class:`~steerkit.SteerModel` (or what a
    :class:`WorkerSpec` loads, such as a vLLM engine).

    Examples:
        >>> list(LocalExecutor(tiny).imap_unordered(lambda sm, x: (sm.n_layers, x), ["a", "b"]))
        [(0, (4, 'a')), (1, (4, 'b'))]
    """

    #: results come from this process (:func:`steerkit.storage.dataset.write_shards` moves its bar batch by batch)
    in_process = True

    def __init__(self, state: Any):
        self.sm = state

    def first(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(sm)`` on this process's model."""
        return fn(self.sm)

    def imap_unordered(self, fn: Callable[[Any, Any], Any], items: Sequence) -> Iterator[tuple[int, Any]]:
        for i, item in enumerate(items):
            yield i, fn(self.sm, item)

    def close(self) -> None:
        pass


def _ray():
    try:
        import ray
    except ImportError:
        raise BackendUnavailableError("expected Ray to run work on a cluster, found it not installed; "
                                      "pip install 'steerkit[ray]' (or pip install ray), or leave out --ray / "
                                      "executor= to run in this process") from None
    return ray


class _Worker:
    """A Ray actor's body: what its spec loads, once; ``run(fn, item)`` calls ``fn(state, item)``."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.sm = spec.load()

    def run(self, fn, item):
        return fn(self.sm, item)

    def ready(self) -> str:
        return self.spec.fingerprint(self.sm)


class RayExecutor:
    """``workers`` Ray actors, each with the model of ``spec`` loaded once (see the module's docstring):
    a :class:`ModelSpec` (steerkit's model), or any :class:`WorkerSpec` (a vLLM engine for recording).

    ``address``: a running cluster (``"auto"``, ``"ray://host:10001"``, ``"127.0.0.1:6379"``), or ``None``
    to start a local one in this process. ``cpus_per_worker`` / ``gpus_per_worker``: what each actor asks
    Ray for (on a GPU worker, ``ModelSpec(device="auto")`` takes the GPU Ray gives it). ``replacements``:
    how many dead workers may be replaced in all (default: as many as there are workers). Use it as a
    context manager, or call :meth:`close`, to stop the workers (a cluster this executor started is shut
    down with them).

    Examples:
        >>> with RayExecutor(ModelSpec(), workers=2) as ex:  # doctest: +SKIP
        ...     sorted(r for _, r in ex.imap_unordered(lambda sm, p: len(sm.tokenize([p]).input_ids[0]), ["a b", "c"]))
        [1, 2]

    (skipped: it starts Ray; ``tests/integration/test_ray.py`` runs it on a local cluster.)
    """

    #: results come from workers, shard by shard
    in_process = False

    def __init__(self, spec: WorkerSpec | None = None, *, workers: int = 2, address: Optional[str] = None,
                 cpus_per_worker: float = 1, gpus_per_worker: float = 0, replacements: Optional[int] = None,
                 namespace: str = "steerkit"):
        if workers < 1:
            raise InputError(f"expected at least 1 Ray worker, found workers={workers}")
        self.spec = spec or ModelSpec()
        self.n_workers = workers
        self.address = address
        self.options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "namespace": namespace}
        self.replacements_left = workers if replacements is None else replacements
        self.run_id = uuid.uuid4().hex[:8]
        self._names = (f"steerkit-{self.run_id}-worker-{k}" for k in itertools.count())
        self.actors: list = []
        self._started_ray = False
        self.fingerprint: Optional[str] = None

    # --- workers ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self.actors:
            return
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.options["namespace"], log_to_driver=False,
                     include_dashboard=False)
            self._started_ray = True
        self.actors = [self._new_actor() for _ in range(self.n_workers)]
        prints = set(ray.get([a.ready.remote() for a in self.actors]))
        if len(prints) != 1:
            raise BackendUnavailableError(f"expected every Ray worker to load the same model, found {len(prints)} "
                                          f"fingerprints ({sorted(prints)}); give every node the same model files")
        self.fingerprint = prints.pop()

    def _new_actor(self):
        ray = _ray()
        cls = ray.remote(_Worker)
        opts = {k: v for k, v in self.options.items() if k != "namespace"}
        return cls.options(name=next(self._names), namespace=self.options["namespace"], max_restarts=0,
                           **opts).remote(self.spec)

    def _replace(self, dead) -> Optional[Any]:
        self.actors = [a for a in self.actors if a is not dead]
        if self.replacements_left <= 0:
            return None
        self.replacements_left -= 1
        actor = self._new_actor()
        self.actors.append(actor)
        return actor

    def first(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(sm)`` on one worker (facts of the model: its name, depth, hook names ...)."""
        self._start()
        ray = _ray()
        return ray.get(self.actors[0].run.remote(lambda sm, _: fn(sm), None))

    # --- work ---------------------------------------------------------------------------------------------
    def imap_unordered(self, fn: Callable[[Any, Any], Any], items: Sequence) -> Iterator[tuple[int, Any]]:
        """``(index, fn(sm, items[index]))`` for every item, as workers finish them; an item whose worker died
        runs again on another."""
        self._start()
        ray = _ray()
        from ray.exceptions import RayActorError, RayTaskError

        queue = collections.deque(range(len(items)))
        idle = list(self.actors)
        pending: dict = {}
        while queue or pending:
            while queue and idle:
                actor, k = idle.pop(), queue.popleft()
                pending[actor.run.remote(fn, items[k])] = (actor, k)
            if not pending:
                raise BackendUnavailableError(f"expected a live Ray worker to run the {len(queue)} remaining "
                                              "item(s), found every worker dead and no replacement left; "
                                              "check the cluster (ray status) and run again to resume")
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            actor, k = pending.pop(ref)
            try:
                result = ray.get(ref)
            except RayTaskError as e:  # fn raised: the worker's own error, as raised there
                raise (e.cause if isinstance(e.cause, BaseException) else e) from None
            except RayActorError:  # the worker died: its item runs again elsewhere
                queue.appendleft(k)
                idle = [a for a in idle if a is not actor]
                new = self._replace(actor)
                if new is not None:
                    idle.append(new)
                continue
            idle.append(actor)
            yield k, result

    def close(self) -> None:
        if not self.actors and not self._started_ray:
            return
        ray = _ray()
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
