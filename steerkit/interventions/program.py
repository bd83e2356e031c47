"""Compiled steering: :func:`compile_steering`, the one lowering step, and the :class:`SiteProgram` it makes
per site (see :mod:`steerkit.interventions`)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.names import parse as parse_hook
from steerkit.kernels import SteerConfig, SteerTable, bind_steer
from steerkit.hooks.positions import PositionSpec, spec_key, validate_positions

from steerkit.interventions.conditions import Condition, Decisions
from steerkit.interventions.facts import ModelFacts
from steerkit.interventions.latents import SiteReads
from steerkit.interventions.lower import _check_condition, _check_source, _structured
from steerkit.interventions.values import KERNEL_OPS, Intervention, Steering, kernel_config

#: distinct position specs among one row's kernel interventions at one site (2^n - 1 combinations)
MAX_POSITION_SPECS = 4


MaskOf = Callable[[PositionSpec], Optional[Tensor]]


class TorchStep(NamedTuple):
    """A torch operation of a site's program: the intervention, the row groups it applies to (``None``: all)
    and, for ``replace`` / ``patch`` / ``apply`` limited to heads or neurons, the features it writes (bool
    ``[width]``, from the compile).

    Examples:
        >>> keep = Intervention.replace("blocks.0.attn.hook_z", torch.zeros(16), heads=[1])  # head 1's 16 values
        >>> program = compile_steering([keep], tiny.facts).programs["blocks.0.attn.hook_z"]
        >>> (step,) = program.steps
        >>> step.intervention.op, step.groups, step.features.nonzero().flatten()[[0, -1]].tolist()
        ('replace', None, [16, 31])
    """

    intervention: Intervention
    groups: Optional[Tensor]
    features: Optional[Tensor]


def _spec_id(p: Intervention):
    """The key of ``p``'s spec in a site's kernel table: its positions and its rule (``when``)."""
    return spec_key(p.positions), None if p.when is None else p.when.key


class SiteProgram:
    """What one site does for a whole batch, compiled once (see the module docstring).

    ``groups``: row groups (one steering each: every row for a shared steering, one group per batch
    row or per served request otherwise). ``kernel``: the bound fused call over ONE table with, per
    group, a configuration for every non-empty subset of its distinct position specs (subset ``b`` of
    group ``g`` is row ``base[g] + b - 1``). ``steps``: torch operations with the groups they apply to.

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> program = compile_steering([add], tiny.facts).programs["blocks.1.hook_resid_post"]
        >>> program.site, program.n_groups, program.table.n_configs
        ('blocks.1.hook_resid_post', 1, 1)
    """

    __slots__ = ("site", "n_groups", "kernel", "table", "specs", "bit_weight", "base", "steps", "simple",
                 "decode_fast", "preserve_norm", "whens", "conditions", "decisions", "_index_tables", "reads",
                 "stores", "_reading")

    def __init__(self, site: str, per_group: Sequence[Sequence[Intervention]], *, d_model: int, device, dtype,
                 impl: str, conditions: Sequence[Condition] = (), decisions: Optional[Decisions] = None,
                 features: Optional[Mapping[int, Tensor]] = None, reads: Optional[SiteReads] = None):
        self.site = site
        # two-site latent edits (transcoders): the steering's one store of source activations
        self.reads = reads
        #: whether this site's activation (before its own edits) is stored for an edit at another site
        self.stores = reads is not None and site in reads.readers
        self._reading = reads is not None and bool(reads.sources_of(site))
        if any(p.latent is not None and p.latent.source is not None for g in per_group for p in g) and not self._reading:
            raise InputError(f"expected the shared SiteReads of a compiled steering at {site!r} (a transcoder's "
                             "clamp reads another site), found none; build programs with "
                             "steerkit.interventions.compile_steering")
        self.n_groups = len(per_group)
        # CAST: the conditions evaluated here (read-only) and the decisions every program of the steering shares
        self.conditions = tuple(conditions)
        self.decisions = decisions
        if (self.conditions or any(p.when is not None for g in per_group for p in g)) and decisions is None:
            raise InputError(f"expected the shared Decisions of a compiled steering at {site!r} (conditions), found "
                             "none; build programs with steerkit.interventions.compile_steering")
        specs: dict = {}  # spec id -> (index, spec)
        kernel_parts: list[list[Intervention]] = [[p for p in g if p.op in KERNEL_OPS] for g in per_group]
        norm = {p.preserve_norm for g in kernel_parts for p in g}
        if len(norm) > 1:
            raise InputError(f"expected preserve_norm to be the same for every kernel intervention at {site!r}, "
                             "found both; apply them at different sites")
        self.preserve_norm = bool(norm and norm.pop())
        configs: list[SteerConfig] = []
        base: list[int] = []
        local_bits: list[dict] = []
        for gi, parts in enumerate(kernel_parts):
            local: dict = {}
            for p in parts:
                sid = _spec_id(p)
                if sid not in specs:
                    specs[sid] = (len(specs), (p.positions, p.when))
                local.setdefault(specs[sid][0], len(local))
            if len(local) > MAX_POSITION_SPECS:
                raise InputError(f"expected at most {MAX_POSITION_SPECS} different position specs among one row's "
                                 f"interventions at {site!r}, found {len(local)}; merge them (steerkit.AnyOf) or "
                                 "use other sites")
            base.append(len(configs))
            local_bits.append(local)
            for b in range(1, 1 << len(local)):
                chosen = [p for p in parts if b >> local[specs[_spec_id(p)][0]] & 1]
                configs.append(kernel_config(chosen, f"{site} (row group {gi})"))
        ordered = [s for _, s in sorted(specs.values(), key=lambda t: t[0])]
        self.specs = [pos for pos, _ in ordered]  # each spec: (positions, when); a rule ANDs the row's decision
        self.whens = [w for _, w in ordered]
        self.table = self.kernel = None
        if configs:
            try:  # the interventions were validated when they were made: stacked, not checked again
                self.table = SteerTable.from_configs(configs, d_model=d_model, device=device, validate=False)
            except InputError as e:
                raise InputError(f"steering at {site!r}: {e}") from None
            self.kernel = bind_steer(self.table, device=device, dtype=dtype, impl=impl,
                                     preserve_norm=self.preserve_norm)
        bw = torch.zeros(self.n_groups, max(1, len(self.specs)), dtype=torch.long)
        for gi, local in enumerate(local_bits):
            for j, bit in local.items():
                bw[gi, j] = 1 << bit
        self.bit_weight = bw.to(device)
        self.base = torch.tensor(base or [0], dtype=torch.long, device=device)
        self._index_tables = {self.base.device: (self.bit_weight, self.base)}  # device -> (bit_weight, base)
        self.steps: list[TorchStep] = []
        order: dict = {}
        for gi, g in enumerate(per_group):
            for p in g:
                if p.op not in KERNEL_OPS:
                    order.setdefault(id(p), [p, set()])[1].add(gi)
        for p, gs in order.values():
            sel = None if len(gs) == self.n_groups else torch.tensor([i in gs for i in range(self.n_groups)],
                                                                        device=device)
            if p.latent is not None:  # the SAE's tensors where the site runs, once
                p = dataclasses.replace(p, latent=p.latent.to(device))
            self.steps.append(TorchStep(p, sel, (features or {}).get(id(p))))
        # one configuration, one spec for every row: the bound call alone (with the spec's mask)
        self.simple = self.n_groups == 1 and len(self.specs) == 1 and self.table is not None \
            and self.table.n_configs == 1
        # ... and a spec that selects every position of a decoding step: no mask at all there
        self.decode_fast = self.simple and not self.steps and not self.stores and self.whens[0] is None \
            and self.specs[0] in ("all", "generated")

    # --- run --------------------------------------------------------------------------
    def __call__(self, x: Float[Tensor, "batch pos d_model"], call) -> Optional[Tensor]:
        """The hook function of a local backend: ``x`` of one call with its :class:`~steerkit.hooks.manager.SiteCall`."""
        run, kernel = call.run, self.kernel
        if self.decode_fast and kernel is not None and run is not None and call.start >= run.P:
            return kernel(x)  # a decoding step: every token, one configuration
        if self.n_groups > 1 and x.shape[0] != self.n_groups:
            raise InputError(f"expected a batch of {self.n_groups} rows (one per steering), found {x.shape[0]}")

        def mask_of(spec):
            if spec == "all" and run is None:
                return None
            return call.mask(spec, x.device)
        rule_of = None
        if self.decisions is not None:
            if run is None:
                raise InputError(f"expected conditional steering (when=) at {self.site!r} to run through "
                                 "SteerModel.forward / generate, found a direct call of the wrapped model; run it "
                                 "through the SteerModel")
            decisions, rid = self.decisions, run.run_id
            if call.start == 0:  # the pass holding the prompt: decide, then hold for the rest of the run
                prompt = call.mask("prompt", x.device)
                for c in self.conditions:
                    decisions.evaluate(c, x, prompt, rid)
            B, dev = int(x.shape[0]), x.device

            def rule_of(when):
                return decisions.rows(when, rid, B, dev)[:, None]
        groups = None
        if self.n_groups > 1:
            groups = torch.arange(self.n_groups, device=x.device)[:, None].expand(x.shape[0], x.shape[1])
        if self.stores:  # a local pass stores one activation here: none an interrupted pass left
            assert self.reads is not None
            self.reads.drop(self.site)
        return self.apply(x, groups, mask_of, call.start, rule_of)

    def _mask(self, positions, when, mask_of: MaskOf, rule_of, lead) -> Optional[Tensor]:
        """The rows a spec selects: its positions AND, with a rule, the rows whose rule fires."""
        m = mask_of(positions)
        if when is None:
            return m
        if rule_of is None:
            raise InputError(f"expected a local run (sm.steer / sm.generate) for the conditional steering (when=) at "
                             f"{self.site!r}, found rows without condition decisions (a server step); conditions are "
                             "not supported there")
        r = rule_of(when).expand(lead)
        return r if m is None else m & r

    def kernel_rows(self, lead: tuple, device, groups: Optional[Tensor], mask_of: MaskOf,
                    rule_of: Optional[Callable] = None) -> Optional[tuple[Optional[Tensor], Optional[Tensor]]]:
        """Which rows of shape ``lead`` the fused kernel steers, and with which configuration of
        :attr:`table`: ``(active, row_config)``, ``None`` for either meaning every row / configuration
        0; ``None`` when it steers no row (arguments as for :meth:`apply`). What :meth:`apply` calls
        the kernel with, and what an engine writes into its steering slots.

        Examples:
            >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), positions="last")
            >>> program = compile_steering([add], tiny.facts).programs["blocks.1.hook_resid_post"]
            >>> active, rc = program.kernel_rows((4,), "cpu", None, lambda spec: torch.tensor([0, 0, 0, 1]).bool())
            >>> active.tolist(), rc
            ([False, False, False, True], None)
        """
        if self.kernel is None:
            return None
        if self.simple:
            m = self._mask(self.specs[0], self.whens[0], mask_of, rule_of, lead)
            if m is None:
                return None, None
            return (m, None) if bool(m.any()) else None
        g = torch.zeros(lead, dtype=torch.long, device=device) if groups is None else groups
        bit_weight, base = self._tables_on(g.device)
        owned = g >= 0
        gc = g.clamp_min(0)
        bits = torch.zeros(lead, dtype=torch.long, device=device)
        for j, spec in enumerate(self.specs):
            m = self._mask(spec, self.whens[j], mask_of, rule_of, lead)
            w = bit_weight[gc, j]
            bits += w if m is None else w * m
        active = owned & (bits > 0)
        if not bool(active.any()):
            return None
        return active, (base[gc] + bits - 1).clamp_min(0)

    def _tables_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(bit_weight, base)`` on ``device`` (a server plans its steps' indices on the host), copied once."""
        hit = self._index_tables.get(device)
        if hit is None:
            hit = self._index_tables[device] = (self.bit_weight.to(device), self.base.to(device))
        return hit

    def apply(self, h: Float[Tensor, "*rows d_model"], groups: Optional[Tensor], mask_of: MaskOf,
              start: int = 0, rule_of: Optional[Callable] = None) -> Optional[Tensor]:
        """``h`` steered (a new tensor), or ``None`` when nothing applies. ``groups``: each row's group
        (``h.shape[:-1]``, ``-1`` for rows no steering owns), ``None`` when every row is group 0.
        ``mask_of(spec)``: the rows a position spec selects (``None``: all of them). ``start``: the
        absolute position of ``h``'s first token (``[batch, pos, ..]`` of a local call; patch uses it).
        ``rule_of(when)``: the rows (broadcastable to ``h.shape[:-1]``) a :class:`When` selects; needed
        only when an intervention has one. At a site that a two-site latent edit reads, ``h`` is stored first
        (:attr:`stores`); an edit that reads another site takes that site's activation of the same pass."""
        reads = self.reads
        if self.stores:
            assert reads is not None
            reads.put(self.site, h)
        try:
            return self._apply(h, groups, mask_of, start, rule_of)
        finally:
            if self._reading:
                assert reads is not None
                reads.release(self.site)

    def _apply(self, h: Tensor, groups: Optional[Tensor], mask_of: MaskOf, start: int,
               rule_of: Optional[Callable]) -> Optional[Tensor]:
        out = None
        lead = h.shape[:-1]
        if self.kernel is not None:
            rows = self.kernel_rows(lead, h.device, groups, mask_of, rule_of)
            if rows is not None:
                out = self.kernel(h, *rows)
        for p, sel, features in self.steps:
            m = self._mask(p.positions, p.when, mask_of, rule_of, lead)
            if sel is not None or groups is not None:  # only the rows of the groups that have it
                g = torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device) if groups is None else groups
                mine = (g >= 0) & (True if sel is None else sel[g.clamp_min(0)])
                m = mine if m is None else m & mine
            if m is not None and not bool(m.any()):
                continue
            x = h if out is None else out
            if p.op == "replace" and p.tensor is not None:
                y = (p.scale * p.tensor.to(device=x.device, dtype=x.dtype)).expand_as(x)
            elif p.op == "patch" and p.tensor is not None:
                y = self._patched(p.tensor, x, m, start)
            elif p.op == "latent" and p.latent is not None:
                src = p.latent.source
                y = p.latent(x) if src is None else p.latent(x, self._source(src, lead).to(x.device))
            elif p.fn is not None:
                y = p.fn(x)
                if not isinstance(y, Tensor) or y.shape != x.shape:
                    raise InputError(f"expected the intervention's fn at {self.site!r} to return a tensor of shape "
                                     f"{tuple(x.shape)}, found {getattr(y, 'shape', type(y).__name__)}")
            else:  # pragma: no cover - the constructors never build one
                raise InputError(f"expected a callable in the apply intervention at {self.site!r}, found None")
            if features is not None:
                y = torch.where(features.to(x.device), y, x)
            out = y if m is None else torch.where(m.unsqueeze(-1), y, x)
        return out

    def _source(self, source: str, lead) -> Tensor:
        """The activation of ``source`` in this pass (a two-site latent edit reads it)."""
        assert self.reads is not None
        return self.reads.get(source, self.site, lead)

    def _patched(self, src: Tensor, x: Tensor, m: Optional[Tensor], start: int) -> Tensor:
        """``x`` with the source's rows at its positions (``[batch, T, width]`` from ``start``)."""
        if x.dim() != 3:
            raise InputError(f"expected patch at {self.site!r} in a local forward pass ([batch, pos, ..]), found "
                             f"rows of shape {tuple(x.shape)}; patch activations with sm.steer / sm.forward")
        if src.shape[1] != x.shape[-1]:
            raise InputError(f"expected the patch source at {self.site!r} to have {x.shape[-1]} features per position "
                             f"(this run), found {src.shape[1]}; was the source run of another length?")
        T, n = x.shape[1], src.shape[0]
        cover = max(0, min(T, n - start))
        if cover < T:
            sel = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if m is None else m
            if bool(sel[:, cover:].any()):
                raise InputError(f"expected the patch at {self.site!r} to select positions its source has (0.."
                                 f"{n - 1}), found position {start + cover} or later selected; give positions= "
                                 "within the source run (e.g. 'prompt')")
        y = x.clone()
        if cover:
            y[:, :cover] = src[start:start + cover].to(device=x.device, dtype=x.dtype)
        return y

    def __repr__(self):
        n = 0 if self.table is None else self.table.n_configs
        return (f"SiteProgram({self.site!r}, groups={self.n_groups}, configs={n}, torch_steps={len(self.steps)}, "
                f"kernel={self.kernel!r})")


@dataclasses.dataclass(frozen=True)
class CompiledSteering:
    """A steering compiled for one model: ``{site: SiteProgram}`` (``n_groups`` row groups).

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> compiled = tiny.compile([add, add.at("last")])
        >>> len(compiled), compiled.n_groups, list(compiled.programs)
        (1, 1, ['blocks.1.hook_resid_post'])
        >>> with tiny.hooks.install(compiled):  # what tiny.steer([add, add.at("last")]) does
        ...     _ = tiny.forward("hi", chat=False)
    """

    programs: Mapping[str, SiteProgram]
    n_groups: int
    interventions: tuple
    state: Optional[Decisions] = None  # the conditions' decisions (CAST), shared by the programs
    reads: Optional[SiteReads] = None  # the source activations two-site latent edits read, shared by the programs

    @property
    def conditions(self) -> tuple:
        """Every distinct :class:`Condition` this steering evaluates."""
        return () if self.state is None else self.state.conditions

    @property
    def decisions(self) -> dict:
        """``{condition: bool tensor [batch]}``: where each condition fired on the latest run (``{}``
        before any run, or without conditions)."""
        return {} if self.state is None else self.state.fired()

    @property
    def similarities(self) -> dict:
        """``{condition: float tensor [batch]}``: each row's similarity on the latest run."""
        return {} if self.state is None else self.state.similarities()

    def __iter__(self):
        return iter(self.programs.items())

    def __len__(self):
        return len(self.programs)


def compile_steering(steering: Union[Steering, Sequence[Optional[Steering]]], facts: ModelFacts, *,
                     per_row: bool = False, device=None, dtype: torch.dtype = torch.float32, impl: str = "auto",
                     positions: Optional[PositionSpec] = None, conditions: Sequence[Condition] = ()) -> CompiledSteering:
    """THE lowering step: interventions -> one :class:`SiteProgram` per site. The interventions were validated
    when they were made; here each is checked against the model (site, width), once.

    ``steering``: a list of :class:`Intervention` (every row), or with ``per_row=True`` a list with one
    list (or ``None``) per row group. Sites are checked against ``facts`` (depth, resid_mid) and tensors
    against its ``d_model`` before anything is built. ``positions``, when given, replaces every
    intervention's own. ``impl`` and any :func:`steerkit.kernels.use_impl` in force are read here.
    ``device``: where the tables live, or a function of the site giving it (a model spread over
    devices: each site's tables on the device its activations are computed on).

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> ablate = Intervention.ablate("blocks.3.hook_resid_post", torch.eye(64)[:2])
        >>> compiled = compile_steering([add, ablate], tiny.facts)
        >>> sorted(compiled.programs), compiled.n_groups
        (['blocks.1.hook_resid_post', 'blocks.3.hook_resid_post'], 1)
        >>> compile_steering([[add], None], tiny.facts, per_row=True).n_groups  # one steering per row
        2
    """
    groups: list[list[Intervention]]
    if per_row:
        if not isinstance(steering, (list, tuple)) or not steering:
            raise InputError("expected a non-empty list with one steering per row, found "
                             f"{type(steering).__name__}")
        groups = [list(g or []) for g in steering]
    else:
        groups = [list(steering)]  # type: ignore[arg-type]
    if positions is not None:
        positions = validate_positions(positions)
        groups = [[p.at(positions) for p in g] for g in groups]
    sites: dict[str, list[list[Intervention]]] = {}
    features: dict[str, dict[int, Tensor]] = {}  # site -> {id(lowered intervention): the features it writes}
    readers: dict[str, list[str]] = {}  # source site -> the sites whose latent edits read it
    for gi, g in enumerate(groups):
        for p in g:
            if not isinstance(p, Intervention):
                raise InputError(f"expected Intervention values, found {type(p).__name__} (row group {gi})")
            kind = parse_hook(p.site, facts.n_layers, has_resid_mid=facts.has_resid_mid).kind
            p, mask = _structured(p, kind, facts)
            if mask is not None:
                features.setdefault(p.site, {})[id(p)] = mask
            d = p.d_model
            w = facts.width(kind, p.site)
            if d is not None and d != w:
                shape = tuple(p.tensor.shape) if p.tensor is not None else (d,)
                what = f"d_model={facts.d_model} of this model" if w == facts.d_model else f"the width of {kind}"
                raise InputError(f"expected the {p.op} vector of shape [{w}] ({what}) at {p.site!r}, found {shape}; "
                                 "was it computed on another model or at another site?")
            sites.setdefault(p.site, [[] for _ in groups])[gi].append(p)
            source = _check_source(p, facts)
            if source is not None:
                readers.setdefault(source, []).append(p.site)
    # two-site latent edits (transcoders): every source site gets a program that stores its activation
    reads = SiteReads(readers) if readers else None
    for source in readers:
        sites.setdefault(source, [[] for _ in groups])
    # CAST: every distinct condition (of a rule, or asked for alone) gets one evaluator at its site
    conds: dict = {}
    for c in list(conditions) + [c for g in groups for p in g if p.when is not None for c in p.when.conditions]:
        if not isinstance(c, Condition):
            raise InputError(f"expected steerkit.Condition values in conditions=, found {type(c).__name__}")
        if c not in conds:
            conds[c] = _check_condition(c, facts)
    if not sites and not conds:
        raise InputError("expected at least one intervention in the steering, found none")
    state = Decisions(tuple(conds)) if conds else None
    at_site: dict[str, list[Condition]] = {}
    for c in conds:
        at_site.setdefault(c.site, []).append(c)
        sites.setdefault(c.site, [[] for _ in groups])
    def device_of(site: str) -> torch.device:
        d = device(site) if callable(device) else device
        return torch.device("cpu") if d is None else torch.device(d)
    programs = {s: SiteProgram(s, per_group, d_model=facts.width(parse_hook(s, facts.n_layers).kind, s) or facts.d_model,
                               device=device_of(s), dtype=dtype, impl=impl, conditions=at_site.get(s, ()),
                               decisions=state if s in at_site or any(p.when is not None for g in per_group for p in g)
                               else None, features=features.get(s),
                               reads=reads if reads is not None and (s in reads.readers or reads.sources_of(s)) else None)
                for s, per_group in sites.items()}
    return CompiledSteering(programs, len(groups), tuple(tuple(g) for g in groups), state, reads)


def compile(*args, **kwargs) -> CompiledSteering:  # noqa: A001 - the former name, kept working
    """The former name of :func:`compile_steering` (it shadowed Python's built-in ``compile``); warns.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     steering = compile([Intervention.add("blocks.1.hook_resid_post", torch.ones(64))], tiny.facts)
        >>> caught[0].category.__name__, list(steering.programs)
        ('DeprecationWarning', ['blocks.1.hook_resid_post'])
    """
    warnings.warn("steerkit.interventions.compile is now steerkit.interventions.compile_steering",
                  DeprecationWarning, stacklevel=2)
    return compile_steering(*args, **kwargs)
