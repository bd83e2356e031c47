"""Export and import of artifacts for other engines.

How it works
------------
``export(artifact, fmt, path)`` writes one of these formats; ``import_artifact(path, fmt)``
reads it back (``fmt=None`` detects it).  Every reader uses the bounded parsers of
:mod:`steerkit.vectors.safety` (no pickle; malformed input -> ``ArtifactFormatError``).

========== ====================================================================================
format     what is written
========== ====================================================================================
llama.cpp  GGUF control vector: ``general.architecture = "controlvector"``,
           ``controlvector.model_hint`` (the model's GGUF architecture name),
           ``controlvector.layer_count`` and float32 1-D tensors ``direction.N`` of length
           n_embd, N = 0-based index of the block whose *output* receives the vector (llama.cpp
           adds ``direction.N`` after block N, i.e. ``blocks.N.hook_resid_post``).  Scale and
           per-layer schedule are folded into the tensors (llama.cpp's own ``--control-vector``
           strength then multiplies them).  Refused: layer 0 (llama.cpp skips such files with a
           log line), layers >= n_layers (silently dropped by llama.cpp), operations other than
           ``add``, token positions and per-token schedules.  Extra ``steerkit.*`` keys (operation,
           hook site, layer base, provenance as JSON) are ignored by llama.cpp.
repeng     The same GGUF layout as written by ``repeng.ControlVector.export_gguf``: model_hint is
           the Hugging Face ``model_type``; layer 0 is allowed (repeng hooks block outputs too).
easysteer  EasySteer's GGUF flavour (``general.architecture = "steervector"``, ``direction.N``)
           plus a request JSON ``<stem>.request.json`` with the fields of EasySteer's current
           ``SteerVectorRequest`` (``scale``, ``target_layers``, ``algorithm = "direct"``,
           ``normalize`` and the where-clause ``apply_spec``: ``{"prompt": "all", "generation":
           "all"}`` for every token, ``{"prompt_positions": [...]}`` for token positions).
           The scale lives in the request, not in the tensors.
easysteer-v1 The same GGUF with the request of EasySteer's first release
           (``prefill_trigger_tokens`` / ``generate_trigger_tokens`` ``[-1]`` or
           ``prefill_trigger_positions``), for servers that still run that release.
tlens      TransformerLens-style intervention spec, JSON ``{hook: {"op", "value", "pos", "scale"}}``
           (``op`` ``add`` or ``clamp``; ``project``, the clamp's name in files of earlier versions,
           imports as ``clamp``) with hooks like ``blocks.15.hook_resid_post``; a DirectionSet ablating everywhere
           becomes ``ablate`` entries on ``hook_embed`` and every ``hook_attn_out``/``hook_mlp_out``.
           Provenance goes under the reserved key ``"__steerkit__"``.
svec       IBM activation-steering ``.svec`` JSON: ``model_type``, ``directions`` {layer: list},
           ``explained_variances``; steerkit's scale/provenance under the extra key ``"steerkit"``
           (IBM's loader ignores unknown keys).
safetensors Plain safetensors with the artifact payload and its metadata JSON in
           ``__metadata__["steerkit"]``; any artifact kind.
========== ====================================================================================

Round trips are exact: ``import_artifact(export(v))`` equals ``v.effective()`` for the GGUF
formats (equal to ``v`` itself when its scale is 1 and it has no schedule) and equals ``v`` for
``easysteer`` (request + GGUF), ``tlens``, ``svec`` and ``safetensors``.  JSON floats are
written with Python's shortest round-trip repr, so float32 values come back bit-identical.

Directional ablation cannot be a control vector; it deploys as weights: see
:func:`steerkit.vectors.gguf_models.write_orthogonalized_gguf`.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from steerkit.storage.naming import is_index

from .artifacts import (HOOK_SITES, VECTOR_OPERATIONS, DirectionSet, SteeringVector, artifact_to_payload, canonical_operation,
                        payload_to_artifact)
from .artifacts.base import payload_file_bytes
from .errors import ArtifactFormatError, ExportError, ModelMismatchError, VectorsError
from .store import Store
from .provenance import Provenance
from .safety import (
    MAX_FILE_BYTES, atomic_write_bytes, check_output_file, parse_gguf, parse_gguf_metadata, parse_safetensors,
    read_bounded, read_head, read_json, read_json_bytes, write_gguf,
)

FORMATS = ("llama.cpp", "repeng", "easysteer", "easysteer-v1", "tlens", "svec", "safetensors")
_EASYSTEER = ("easysteer", "easysteer-v1")
_ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "gguf": "llama.cpp", "transformerlens": "tlens",
            "transformer_lens": "tlens", "ibm": "svec", "st": "safetensors", "steerkit": "safetensors"}
# Hugging Face model_type -> GGUF general.architecture (llama.cpp's model_hint)
HF_TO_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                   "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "phi3": "phi3", "gpt2": "gpt2",
                   "olmo": "olmo", "olmo2": "olmo2", "granite": "granite", "stablelm": "stablelm"}
_LAYER = r"(0|[1-9][0-9]{0,5})"  # a layer index by steerkit.storage.naming (ASCII, no leading zero), at most 6 digits
_HOOK_RE = re.compile(r"blocks\." + _LAYER + r"\.(" + "|".join(HOOK_SITES) + r")\Z", re.ASCII)
_GGUF_HEAD_BYTES = 1 << 20  # the metadata of a GGUF is checked from this prefix before the whole file is read
_CONTROL_ARCHS = ("controlvector", "steervector")


def normalize_format(fmt: str) -> str:
    """The canonical name of an export format (one of ``FORMATS``), aliases and case accepted.

    Examples:
        >>> from steerkit.vectors.exports import normalize_format
        >>> normalize_format("GGUF"), normalize_format("ibm"), normalize_format("transformer_lens")
        ('llama.cpp', 'svec', 'tlens')
    """
    f = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if f not in FORMATS:
        raise VectorsError(f"expected a format in {FORMATS}, found {fmt!r}")
    return f


# ============================================================================ helpers
def _require_vector(a: Any, fmt: str) -> SteeringVector:
    if isinstance(a, DirectionSet):
        raise ExportError(
            f"a DirectionSet (directional ablation) cannot be expressed as a {fmt} steering vector; "
            "deploy it as weights with steerkit.vectors.write_orthogonalized_gguf(...) (llama.cpp), "
            "or export it with format 'tlens' or 'safetensors'"
        )
    if not isinstance(a, SteeringVector):
        raise ExportError(f"expected a SteeringVector for format {fmt!r}, found {type(a).__name__}; "
                          "export other artifacts with format 'safetensors'")
    return a


def _refuse_unexpressible(v: SteeringVector, fmt: str, *, allow_positions: bool = False) -> None:
    if v.operation != "add":
        raise ExportError(
            f"{fmt} can only add a vector to the residual stream; this vector's operation is {v.operation!r}. "
            "Export it with format 'tlens' or 'safetensors' instead, or convert it to an additive vector"
        )
    if v.hook_site != "hook_resid_post":
        where = ("move it to the previous block's hook_resid_post or " if v.hook_site == "hook_resid_pre" else "")
        raise ExportError(f"{fmt} steers block outputs (hook_resid_post) only, this vector is at {v.hook_site}; "
                          f"{where}export it as 'tlens'/'safetensors'")
    if v.positions is not None and not allow_positions:
        raise ExportError(f"{fmt} applies a vector at every token; this vector is limited to positions {v.positions}. "
                          "Export it as 'easysteer' (trigger positions), 'tlens' or 'safetensors' instead")
    if v.schedule is not None and v.schedule.position_weights is not None:
        raise ExportError(f"{fmt} cannot express a per-token schedule; export as 'tlens' or 'safetensors' instead, "
                          "or drop the schedule's position_weights")


def _check_layers(v: SteeringVector, n_layers: int | None, fmt: str, *, allow_zero: bool) -> None:
    if not allow_zero and 0 in v.directions:
        raise ExportError(
            f"{fmt} cannot steer block 0: llama.cpp skips a control-vector file containing direction.0 "
            "(it only logs a line). Move the vector to layer >= 1 (e.g. the same direction at layer 1), "
            "or export it as 'repeng', 'easysteer', 'tlens' or 'safetensors'"
        )
    if n_layers is None:
        if fmt == "llama.cpp":
            raise ExportError("expected the model's n_layers to be known (llama.cpp silently drops direction tensors "
                              "for layers >= n_layer), found none in the provenance; pass model=... to export()")
        return
    bad = [l for l in v.directions if l >= n_layers]
    if bad:
        raise ExportError(f"expected layers below n_layers={n_layers}, found {bad}; {fmt} would drop them silently. "
                          "Check the layer indices (0-based)")


def _model_fill(prov: Provenance, model: Any, d_model: int) -> Provenance:
    """Fill unknown model fields of ``prov`` from ``model`` and check the known ones."""
    if model is None:
        return prov
    mp = Provenance.from_model(model)
    if mp.d_model is not None and mp.d_model != d_model:
        raise ModelMismatchError(f"expected vectors of the model's d_model={mp.d_model}, found {d_model}")
    upd = {k: getattr(mp, k) for k in ("model_name", "model_fingerprint", "model_arch", "d_model", "n_layers")
           if getattr(prov, k) is None}
    return prov.replace(**upd)


def _gguf_arch_of(prov: Provenance, model: Any) -> str:
    src = getattr(model, "source_gguf", None) if model is not None else None
    if src:
        try:
            f = gguf.GGUFReader(src).get_field("general.architecture")
            if f is not None:
                return str(f.contents())
        except Exception:
            pass
    arch = prov.model_arch
    return HF_TO_GGUF_ARCH.get(arch, arch) if arch else "unknown"


def _json_floats(t: torch.Tensor) -> list:
    return t.detach().cpu().to(torch.float64).tolist()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _dtype_from(name: Any) -> torch.dtype:
    allowed = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name not in allowed:
        raise ArtifactFormatError(f"expected dtype in {sorted(allowed)}, found {name!r:.50}")
    return allowed[name]


def _finite(x: Any, what: str) -> float:
    """``x`` as a finite float, else ArtifactFormatError (a JSON integer too large for a float included)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ArtifactFormatError(f"expected {what} as a number, found {type(x).__name__}")
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        found = f"an integer of {x.bit_length()} bits" if isinstance(x, int) else repr(x)
        raise ArtifactFormatError(f"expected {what} as a finite number, found {found}; the file is corrupted")
    return f


def _float_list(x: Any, what: str, max_len: int = 1 << 20) -> list[float]:
    if not isinstance(x, list) or len(x) > max_len:
        raise ArtifactFormatError(f"expected {what} as a list of at most {max_len} numbers, found {str(x)[:80]}")
    return [_finite(v, f"element {i} of {what}") for i, v in enumerate(x)]


def _vector_tensor(x: Any, what: str, dtype: torch.dtype) -> torch.Tensor:
    """A list of JSON numbers as a tensor of ``dtype``; values that overflow ``dtype`` are refused."""
    t = torch.tensor(_float_list(x, what), dtype=torch.float64).to(dtype)
    if not bool(torch.isfinite(t).all()):
        raise ArtifactFormatError(f"expected {what} within the range of {_dtype_name(t)}, found values that overflow "
                                  "it; export the vector as float64 or rescale it")
    return t


def _int_list(x: Any, what: str) -> list[int]:
    if (not isinstance(x, list) or len(x) > 1 << 20
            or not all(isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31 for v in x)):
        raise ArtifactFormatError(f"expected {what} as a list of integers in [-2^31, 2^31), found {str(x)[:80]}")
    return x


# ============================================================================ GGUF control vectors
def _gguf_kv(v: SteeringVector, fmt: str, hint: str, folded_scale: float) -> dict:
    return {
        "controlvector.model_hint" if fmt not in _EASYSTEER else "steervector.model_hint": hint,
        "controlvector.layer_count" if fmt not in _EASYSTEER else "steervector.layer_count": len(v.directions),
        "steerkit.format": fmt,
        "steerkit.operation": v.operation,
        "steerkit.hook_site": v.hook_site,
        "steerkit.layer_base": v.provenance.layer_base,
        "steerkit.scale_folded": float(folded_scale),
        "steerkit.dtype": _dtype_name(next(iter(v.directions.values()))),
        "steerkit.provenance": json.dumps(v.provenance.to_dict(), sort_keys=True),
    }


def _export_gguf_vector(v: SteeringVector, fmt: str, path: Path, model: Any, scale: float | None) -> list[Path]:
    _refuse_unexpressible(v, fmt, allow_positions=(fmt in _EASYSTEER))
    prov = _model_fill(v.provenance, model, v.d_model)
    _check_layers(v, prov.n_layers, fmt, allow_zero=(fmt != "llama.cpp"))
    if fmt in _EASYSTEER:  # scale goes into the request; fold only the per-layer schedule
        base = SteeringVector(v.directions, 1.0, v.operation, v.hook_site, None, v.schedule, v.provenance).effective()
        folded = 1.0
    else:
        base = v.effective()
        folded = v.scale
        if scale is not None:
            base = base * float(scale)
            folded *= float(scale)
    base = SteeringVector(base.directions, 1.0, base.operation, base.hook_site, None, None, prov)
    if fmt == "llama.cpp":
        hint = _gguf_arch_of(prov, model)
        arch = "controlvector"
    elif fmt == "repeng":
        hint = prov.model_arch or "unknown"
        arch = "controlvector"
    else:
        hint = prov.model_arch or "unknown"
        arch = "steervector"
    tensors = {f"direction.{l}": d.detach().cpu().to(torch.float32).numpy() for l, d in base.directions.items()}
    kv = _gguf_kv(base, fmt, hint, folded)
    kv["steerkit.dtype"] = _dtype_name(next(iter(v.directions.values())))
    write_gguf(path, arch, kv, tensors)
    out = [path]
    if fmt in _EASYSTEER:
        req = easysteer_request(v, path, name=path.stem, version="v1" if fmt == "easysteer-v1" else "current")
        rp = easysteer_request_path(path)
        atomic_write_bytes(rp, json.dumps(req, indent=1).encode())
        out.append(rp)
    return out


def easysteer_request_path(gguf_path: str | os.PathLike) -> Path:
    """Where the EasySteer request JSON of ``gguf_path`` goes: ``<stem>.request.json`` beside it.

    Examples:
        >>> from steerkit.vectors.exports import easysteer_request_path
        >>> easysteer_request_path("out/happy.gguf").as_posix()
        'out/happy.request.json'
    """
    p = Path(gguf_path)
    stem = p.name[: -len(".gguf")] if p.name.endswith(".gguf") else p.name
    return p.with_name(stem + ".request.json")


#: EasySteer's where-clause for "every prompt token and every generated token"
EASYSTEER_ALL = {"prompt": "all", "generation": "all"}
EASYSTEER_VERSIONS = ("current", "v1")


def easysteer_request(v: SteeringVector, gguf_path: str | os.PathLike, *, name: str = "steerkit", int_id: int = 1,
                      version: str = "current") -> dict:
    """The EasySteer ``SteerVectorRequest`` fields for ``v`` stored at ``gguf_path``.

    ``version="current"`` writes EasySteer's current request (the where-clause as ``apply_spec``:
    every token, or ``prompt_positions`` when ``v`` has token positions; negative positions count
    from the end of the prompt in both libraries); ``version="v1"`` the first release's trigger
    fields. Fields left at EasySteer's defaults are omitted, as its own serialiser omits them.

    Examples:
        >>> from steerkit.vectors import SteeringVector, easysteer_request
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, scale=4.0)
        >>> req = easysteer_request(v, tmp_dir / "happy.gguf")
        >>> req["scale"], req["target_layers"], req["apply_spec"]
        (4.0, [2], {'prompt': 'all', 'generation': 'all'})
        >>> easysteer_request(v, tmp_dir / "happy.gguf", version="v1")["prefill_trigger_tokens"]
        [-1]
    """
    if version not in EASYSTEER_VERSIONS:
        raise ExportError(f"expected an EasySteer request version in {EASYSTEER_VERSIONS}, found {version!r}")
    req: dict[str, Any] = {
        "steer_vector_name": name,
        "steer_vector_int_id": int(int_id),
        "steer_vector_local_path": str(Path(gguf_path).resolve()),
        "scale": float(v.scale),
        "target_layers": sorted(v.directions),
        "algorithm": "direct",
        "normalize": False,
    }
    if version == "current":
        req["apply_spec"] = dict(EASYSTEER_ALL) if v.positions is None else {"prompt_positions": list(v.positions)}
    elif v.positions is None:
        req["prefill_trigger_tokens"] = [-1]
        req["generate_trigger_tokens"] = [-1]
    else:
        req["prefill_trigger_positions"] = list(v.positions)
    return req


def _easysteer_positions(req: dict, path: Path) -> list[int] | None:
    """The token positions of a request of either EasySteer version (``None``: every token)."""
    spec = req.get("apply_spec")
    if spec is None:
        pos = req.get("prefill_trigger_positions")
        return None if pos is None else _int_list(pos, "prefill_trigger_positions")
    if not isinstance(spec, dict):
        raise ArtifactFormatError(f"expected apply_spec in {path} to be an object, found {type(spec).__name__}")
    used = {k: x for k, x in spec.items() if x is not None}
    if used == EASYSTEER_ALL:
        return None
    if set(used) == {"prompt_positions"}:
        return _int_list(used["prompt_positions"], "apply_spec.prompt_positions")
    raise ArtifactFormatError(
        f"expected an apply_spec steerkit can express ({EASYSTEER_ALL} or {{'prompt_positions': [...]}}), found "
        f"{sorted(used)} in {path}; token-id, window and generation-step selectors have no SteeringVector equivalent")


def _check_control_arch(arch: Any, path: Path) -> None:
    if arch not in _CONTROL_ARCHS:
        raise ArtifactFormatError(
            f"expected a control-vector GGUF (general.architecture 'controlvector' or 'steervector') at {path}, "
            f"found {arch!r:.80}; a model GGUF is not a steering vector"
        )


def _import_gguf_vector(path: Path, fmt_hint: str | None, model: Any, max_bytes: int) -> SteeringVector:
    try:  # a model GGUF is refused from its first bytes, before the whole file is read
        head_meta = parse_gguf_metadata(read_head(path, _GGUF_HEAD_BYTES), f"GGUF file {path}")
    except ArtifactFormatError:
        head_meta = None  # metadata longer than the prefix, or malformed: the full parse below says which
    if head_meta is not None:
        _check_control_arch(head_meta.get("general.architecture"), path)
    meta, tensors = parse_gguf(read_bounded(path, max_bytes), f"GGUF file {path}")
    arch = meta.get("general.architecture")
    _check_control_arch(arch, path)
    dirs: dict[int, torch.Tensor] = {}
    width: int | None = None  # set with the first direction
    for name, arr in tensors.items():
        m = re.fullmatch(r"direction\." + _LAYER, name, re.ASCII)
        if not m:
            raise ArtifactFormatError(f"expected only tensors named direction.N in {path}, found {name!r}")
        if arr.ndim != 1 or (width is not None and arr.shape[0] != width):
            raise ArtifactFormatError(f"expected 1-D direction tensors of equal length in {path}, found {name} with shape {arr.shape}")
        width = arr.shape[0]
        dirs[int(m.group(1))] = torch.from_numpy(arr.astype(np.float32))
    if not dirs or width is None:
        raise ArtifactFormatError(f"expected at least one direction.N tensor in {path}, found none")
    prov_json = meta.get("steerkit.provenance")
    if prov_json is not None:
        if not isinstance(prov_json, str):
            raise ArtifactFormatError("expected steerkit.provenance to be a JSON string")
        prov = Provenance.from_dict(read_json_bytes(prov_json.encode(), "steerkit.provenance"))
    else:
        hint = meta.get("controlvector.model_hint", meta.get("steervector.model_hint"))
        prov = Provenance(model_arch=hint if isinstance(hint, str) else None, d_model=width,
                          method=f"imported:{fmt_hint or arch}")
    dt = meta.get("steerkit.dtype", "float32")
    dtype = _dtype_from(dt)
    prov = _model_fill(prov, model, width)
    return SteeringVector({l: d.to(dtype) for l, d in dirs.items()}, provenance=prov)


# ============================================================================ tlens
def _export_tlens(a: Any, path: Path, model: Any) -> list[Path]:
    spec: dict[str, Any] = {}
    if isinstance(a, SteeringVector):
        if a.schedule is not None and a.schedule.position_weights is not None:
            raise ExportError("tlens intervention specs have no per-token weights; export as 'safetensors' instead")
        prov = _model_fill(a.provenance, model, a.d_model)
        base = SteeringVector(a.directions, 1.0, a.operation, a.hook_site, a.positions, a.schedule, prov).effective()
        for l, d in base.directions.items():
            spec[a.hook_name(l)] = {"op": a.operation, "value": _json_floats(d), "pos": a.positions, "scale": a.scale}
        dtype = _dtype_name(next(iter(a.directions.values())))
    elif isinstance(a, DirectionSet):
        prov = _model_fill(a.provenance, model, a.d_model)
        value = [_json_floats(r) for r in a.basis]
        if a.layers is None:
            if prov.n_layers is None:
                raise ExportError("expected n_layers to be known to spell out every hook of an ablate-everywhere "
                                  "DirectionSet, found none; pass model=... to export()")
            hooks = ["hook_embed"] + [f"blocks.{l}.{h}" for l in range(prov.n_layers) for h in ("hook_attn_out", "hook_mlp_out")]
        else:
            hooks = [f"blocks.{l}.{a.hook_site}" for l in a.layers]
        for h in hooks:
            spec[h] = {"op": "ablate", "value": value, "pos": None}
        dtype = _dtype_name(a.basis)
    else:
        raise ExportError(f"expected a SteeringVector or DirectionSet for format 'tlens', found {type(a).__name__}; "
                          "use 'safetensors' for probes, regions and schedules")
    spec["__steerkit__"] = {"kind": a.kind, "dtype": dtype, "provenance": prov.to_dict()}
    atomic_write_bytes(path, json.dumps(spec).encode())
    return [path]


def _import_tlens(obj: dict, path: Path, model: Any) -> Any:
    sk = obj.get("__steerkit__", {})
    if not isinstance(sk, dict):
        raise ArtifactFormatError("expected '__steerkit__' to be an object")
    dtype = _dtype_from(sk.get("dtype", "float32"))
    entries = {k: v for k, v in obj.items() if k != "__steerkit__"}
    if not entries:
        raise ArtifactFormatError(f"expected at least one hook entry in {path}, found none")
    ops = set()
    for k, e in entries.items():
        if not isinstance(e, dict) or "op" not in e or "value" not in e:
            raise ArtifactFormatError(f"expected {{'op', 'value', 'pos'}} for hook {k!r:.80}, found {str(e)[:80]}")
        if not isinstance(e["op"], str):
            raise ArtifactFormatError(f"expected 'op' of hook {k!r:.80} to be a string such as 'add' or 'ablate', "
                                      f"found {type(e['op']).__name__} {str(e['op'])[:40]}")
        ops.add(e["op"])
    prov_d = sk.get("provenance")
    if ops == {"ablate"}:
        first = next(iter(entries.values()))["value"]
        if not isinstance(first, list) or not first:
            raise ArtifactFormatError("expected an ablate value as a list of basis rows")
        if len(first) > 4096:
            raise ArtifactFormatError(f"expected an ablate basis of at most 4096 rows, found {len(first)}")
        rows = [_vector_tensor(r, f"basis row {i}", dtype) for i, r in enumerate(first)]
        widths = sorted({len(r) for r in rows})
        if len(widths) != 1 or widths[0] == 0:
            raise ArtifactFormatError(f"expected ablate basis rows of one non-zero length (d_model), found lengths "
                                      f"{widths[:5]}; every row must be a full direction")
        if any(e["value"] != first for e in entries.values()):
            raise ArtifactFormatError("expected every ablate entry to use the same basis, found different ones; "
                                      "steerkit DirectionSets ablate one basis")
        basis = torch.stack(rows)
        hooks = set(entries)
        resid = sorted(int(m.group(1)) for m in (_HOOK_RE.match(h) for h in hooks) if m and m.group(2) in ("hook_resid_post", "hook_resid_pre"))
        if "hook_embed" in hooks:
            layers = None
        elif resid and len(resid) == len(hooks):
            layers = resid
        else:
            raise ArtifactFormatError(f"expected ablate hooks either everywhere (hook_embed + attn/mlp outs) or at "
                                      f"blocks.N.hook_resid_post, found {sorted(hooks)[:5]}")
        prov = Provenance.from_dict(prov_d) if prov_d is not None else Provenance(d_model=basis.shape[1], method="imported:tlens")
        prov = _model_fill(prov, model, basis.shape[1])
        return DirectionSet(basis, layers=layers, provenance=prov)
    ops = {canonical_operation(o) for o in ops}  # "project": the clamp's name in files of earlier versions
    if not ops <= set(VECTOR_OPERATIONS) or len(ops) != 1:
        raise ArtifactFormatError(f"expected all entries to be 'add', all 'clamp' or all 'ablate', found ops {sorted(map(str, ops))}")
    dirs, scales, poss, sites = {}, set(), [], set()
    for k, e in entries.items():
        m = _HOOK_RE.match(k)
        if not m:
            raise ArtifactFormatError(f"expected hooks named blocks.N.<site> with a site in {HOOK_SITES}, found {k!r:.80}")
        sites.add(m.group(2))
        dirs[int(m.group(1))] = _vector_tensor(e["value"], f"value of {k}", dtype)
        scales.add(_finite(e.get("scale", 1.0), f"the scale of {k}"))
        pos = e.get("pos")
        if pos is not None:
            pos = _int_list(pos, f"pos of {k}")
        poss.append(pos)
    if len(scales) != 1 or any(p != poss[0] for p in poss) or len(sites) != 1 or len({len(d) for d in dirs.values()}) != 1:
        raise ArtifactFormatError("expected one scale, one pos, one hook site and one vector length across entries, "
                                  "found several; split the spec into one file per vector")
    width = next(iter(dirs.values())).shape[0]
    prov = Provenance.from_dict(prov_d) if prov_d is not None else Provenance(d_model=width, method="imported:tlens")
    prov = _model_fill(prov, model, width)
    return SteeringVector(dirs, scale=scales.pop(), operation=ops.pop(), hook_site=sites.pop(), positions=poss[0], provenance=prov)


# ============================================================================ IBM svec
def _export_svec(v: SteeringVector, path: Path, model: Any) -> list[Path]:
    _refuse_unexpressible(v, "svec")
    prov = _model_fill(v.provenance, model, v.d_model)
    base = SteeringVector(v.directions, 1.0, v.operation, v.hook_site, None, v.schedule, prov).effective()
    ev = prov.metrics.get("explained_variance", {}) if isinstance(prov.metrics.get("explained_variance"), dict) else {}
    data = {
        "model_type": prov.model_arch or "unknown",
        "directions": {str(l): _json_floats(d) for l, d in base.directions.items()},
        "explained_variances": {str(l): ev.get(str(l)) for l in base.directions},
        "steerkit": {"scale": v.scale, "dtype": _dtype_name(next(iter(v.directions.values()))), "provenance": prov.to_dict()},
    }
    atomic_write_bytes(path, json.dumps(data).encode())
    return [path]


def _import_svec(obj: dict, path: Path, model: Any) -> SteeringVector:
    d = obj.get("directions")
    if not isinstance(d, dict) or not d:
        raise ArtifactFormatError(f"expected 'directions' as a non-empty object {{layer: [floats]}} in {path}, found {str(d)[:80]}")
    sk = obj.get("steerkit", {})
    if not isinstance(sk, dict):
        raise ArtifactFormatError("expected 'steerkit' to be an object")
    dtype = _dtype_from(sk.get("dtype", "float32"))
    dirs = {}
    for k, vals in d.items():
        if not (is_index(k) and len(k) <= 6):
            raise ArtifactFormatError(f"expected layer keys in 'directions' as ASCII digits without a leading zero, "
                                      f"found {k!r:.40}")
        dirs[int(k)] = _vector_tensor(vals, f"direction {k}", dtype)
    widths = sorted({len(t) for t in dirs.values()})
    if len(widths) != 1:
        raise ArtifactFormatError(f"expected directions of one length (d_model) in {path}, found lengths {widths[:5]}")
    width = widths[0]
    mt = obj.get("model_type")
    if "provenance" in sk:
        prov = Provenance.from_dict(sk["provenance"])
    else:
        prov = Provenance(model_arch=mt if isinstance(mt, str) else None, d_model=width, method="imported:svec")
    prov = _model_fill(prov, model, width)
    scale = _finite(sk.get("scale", 1.0), "steerkit.scale")
    return SteeringVector(dirs, scale=scale, provenance=prov)


# ============================================================================ safetensors
def save_artifact(artifact: Any, path: str | os.PathLike) -> Path:
    """Write any artifact as one safetensors file (payload + metadata JSON).

    Examples:
        >>> from steerkit.vectors import DirectionSet, import_artifact, save_artifact
        >>> ablation = DirectionSet.from_directions(torch.randn(2, 64), tiny)
        >>> path = save_artifact(ablation, tmp_dir / "ablation.safetensors")
        >>> import_artifact(path) == ablation
        True
    """
    data = payload_file_bytes(*artifact_to_payload(artifact))
    atomic_write_bytes(check_output_file(path, "artifact file"), data)
    return Path(path)


def _import_safetensors(path: Path, model: Any, max_bytes: int) -> Any:
    tensors, meta = parse_safetensors(read_bounded(path, max_bytes), f"safetensors file {path}")
    if "steerkit" in meta:
        m = read_json_bytes(meta["steerkit"].encode(), "steerkit metadata")
        a = payload_to_artifact(tensors, m)
        if model is not None and hasattr(a, "provenance"):
            a.provenance = _model_fill(a.provenance, model, a.d_model)
        return a
    # plain safetensors from elsewhere: direction.N / layer keys -> SteeringVector
    dirs = {}
    for k, t in tensors.items():
        m = re.fullmatch(r"(?:direction\.|layer\.|layers\.)?" + _LAYER, k, re.ASCII)
        if not m or t.ndim != 1 or not t.is_floating_point():
            raise ArtifactFormatError(f"expected a steerkit safetensors file or 1-D float tensors named direction.N, found {k!r} {tuple(t.shape)}")
        dirs[int(m.group(1))] = t
    if not dirs:
        raise ArtifactFormatError(f"expected tensors in {path}, found none")
    width = next(iter(dirs.values())).shape[0]
    prov = _model_fill(Provenance(d_model=width, method="imported:safetensors"), model, width)
    return SteeringVector(dirs, provenance=prov)


# ============================================================================ public API
def export(artifact: Any, fmt: str, path: str | os.PathLike, *, model: Any = None, scale: float | None = None) -> list[Path]:
    """Write ``artifact`` in format ``fmt`` (one of ``FORMATS``) to ``path``.

    ``model`` (optional) fills provenance fields the artifact lacks (n_layers, architecture) and is
    checked against them.  ``scale`` (llama.cpp/repeng only) multiplies the folded vector.
    Returns the paths written (easysteer writes the GGUF and ``<stem>.request.json``).

    Examples:
        >>> from steerkit.vectors import SteeringVector, export
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny, scale=4.0)
        >>> [p.name for p in export(v, "llama.cpp", tmp_dir / "happy.gguf")]
        ['happy.gguf']
        >>> [p.name for p in export(v, "easysteer", tmp_dir / "happy-es.gguf")]
        ['happy-es.gguf', 'happy-es.request.json']
    """
    fmt = normalize_format(fmt)
    path = check_output_file(path, f"{fmt} export")
    if fmt == "safetensors":
        return [save_artifact(artifact, path)]
    if fmt == "tlens":
        return _export_tlens(artifact, path, model)
    v = _require_vector(artifact, fmt)
    if fmt == "svec":
        return _export_svec(v, path, model)
    return _export_gguf_vector(v, fmt, path, model, scale)


def detect_format(path: str | os.PathLike) -> str:
    """Sniff a file's kind from its first bytes and suffix: ``"gguf"``, ``"svec"``, ``"safetensors"``
    or ``"json"`` (:class:`ArtifactFormatError` for anything else).

    Examples:
        >>> from steerkit.vectors import SteeringVector, export
        >>> from steerkit.vectors.exports import detect_format
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny)
        >>> paths = export(v, "easysteer", tmp_dir / "v.gguf")
        >>> [detect_format(p) for p in paths]
        ['gguf', 'json']
    """
    p = Path(path)
    head = read_head(p, 4096)  # the first bytes only, however large the file
    if head[:4] == b"GGUF":
        return "gguf"
    if p.suffix == ".svec":
        return "svec"
    if p.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        return "safetensors"
    if p.suffix == ".json" or head[:1] in (b"{", b"["):
        return "json"
    raise ArtifactFormatError(f"expected a GGUF, safetensors, .svec or JSON file at {p}, could not tell what it is; pass fmt=")


def import_artifact(path: str | os.PathLike, fmt: str | None = None, *, model: Any = None,
                    max_bytes: int = MAX_FILE_BYTES) -> Any:
    """Read an artifact written by :func:`export` or by the other engine's own tools.

    Examples:
        >>> from steerkit.vectors import SteeringVector, export, import_artifact
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny, scale=4.0)
        >>> gguf, request = export(v, "easysteer", tmp_dir / "happy.gguf")
        >>> import_artifact(request) == v  # the request carries the scale
        True
        >>> w = import_artifact(gguf)  # the GGUF alone: EasySteer keeps the scale in the request
        >>> w.scale, float(w.directions[2][0])
        (1.0, 1.0)
    """
    p = Path(path)
    kind = normalize_format(fmt) if fmt else detect_format(p)
    if kind in ("llama.cpp", "repeng", "gguf") or (kind in _EASYSTEER and p.suffix == ".gguf"):
        return _import_gguf_vector(p, None if kind == "gguf" else kind, model, max_bytes)
    if kind == "safetensors":
        return _import_safetensors(p, model, max_bytes)
    obj = read_json(p, "artifact JSON", max_bytes)
    if not isinstance(obj, dict):
        raise ArtifactFormatError(f"expected a JSON object in {p}, found {type(obj).__name__}")
    if kind == "svec" or (kind == "json" and "directions" in obj and "model_type" in obj):
        return _import_svec(obj, p, model)
    if kind in _EASYSTEER or (kind == "json" and "steer_vector_local_path" in obj):
        return _import_easysteer_request(obj, p, model, max_bytes)
    return _import_tlens(obj, p, model)


def _import_easysteer_request(req: dict, path: Path, model: Any, max_bytes: int) -> SteeringVector:
    lp = req.get("steer_vector_local_path")
    if not isinstance(lp, str) or not lp:
        raise ArtifactFormatError(f"expected steer_vector_local_path in {path}, found {lp!r:.80}")
    # Only ever follow the file *name*, next to the request: a stranger's request must not make
    # us read arbitrary files.
    name = Path(lp).name
    gp = path.parent / name
    if not name.endswith(".gguf") or not gp.is_file():
        raise ArtifactFormatError(f"expected the GGUF {name!r} next to {path} (requests are resolved by file name "
                                  "in their own folder), found none; copy the GGUF beside the request")
    v = _import_gguf_vector(gp, "easysteer", model, max_bytes)
    if req.get("algorithm", "direct") != "direct" or req.get("normalize", False):
        raise ArtifactFormatError("expected an EasySteer 'direct' request without normalize; other algorithms are not steering vectors")
    scale = _finite(req.get("scale", 1.0), "the request's scale")
    tl = req.get("target_layers")
    if tl is not None:
        tl = _int_list(tl, "target_layers")
        missing = sorted(set(tl) - set(v.directions))
        if missing:
            raise ArtifactFormatError(f"expected the GGUF to hold every target layer, found none for {missing}")
        v = SteeringVector({l: v.directions[l] for l in sorted(set(tl))}, provenance=v.provenance)
    return SteeringVector(v.directions, scale=scale, positions=_easysteer_positions(req, path), provenance=v.provenance)


def load_artifact(path_or_ref: str | os.PathLike, fmt: str | None = None, *, model: Any = None, store: Any = None) -> Any:
    """Load from a file (any supported format) or, if no such file exists, from the store by reference.

    Examples:
        >>> from steerkit.vectors import SteeringVector, export, load_artifact
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny)
        >>> store.save("happy", v)
        'happy@1'
        >>> load_artifact("happy@1", store=store) == v
        True
        >>> _ = export(v, "svec", tmp_dir / "happy.svec")
        >>> load_artifact(tmp_dir / "happy.svec").layers
        [2]
    """
    p = Path(path_or_ref)
    if p.exists():
        return import_artifact(p, fmt, model=model)
    return (store or Store()).load(str(path_or_ref))
