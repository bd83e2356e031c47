"""Model GGUF files: de-quantised copies and weight-orthogonalised copies for llama.cpp.

How it works
------------
:func:`rewrite_gguf` reads a (possibly quantised) model GGUF with ``gguf.GGUFReader``,
de-quantises every tensor with ``gguf.quants.dequantize`` into float32 numpy arrays, lets a
``transform`` callback change them, and writes a new GGUF with *the same metadata* (every
key/value copied with its GGUF type; ``general.file_type`` set to F32 or F16) and the tensors
in float32, or float16 for 2-D weight matrices when ``dtype="f16"``.  The file is written to a
temporary name and renamed when complete; the destination folder must exist.

:func:`write_dequantized_gguf` is the identity transform: a float32 GGUF whose weights are
bit-identical to what Hugging Face ``transformers`` loads from the same quantised file, which
makes llama.cpp and PyTorch comparable number for number.

:func:`write_orthogonalized_gguf` deploys a :class:`DirectionSet` (ablation everywhere) as
weights: with ``P = I - B^T B``, the token embedding ``E <- E P`` and every matrix that writes
into the residual stream (``blk.N.attn_output``, ``blk.N.ffn_down``: ``W <- P W``) is
projected, so the residual stream never gains a component in ``span(B)`` -- the same as
ablating ``B`` from the embedding output and every attention and MLP output at run time.  If
the model ties its output head to the embedding (no ``output.weight``), the original embedding
is written as ``output.weight`` so the head is unchanged.  The projection is
:func:`steerkit.vectors.bake.bake_tensors` (float64), the one the Hugging Face path
(:func:`steerkit.vectors.bake.bake_model`) uses; biases of the residual writers, where a model has
them, are projected too.  These files are trusted local inputs; untrusted control-vector files go through
:func:`steerkit.vectors.safety.parse_gguf` instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch

from .apply import check_compatible
from .artifacts import DirectionSet
from .bake import bake_tensors, check_basis
from .errors import ArtifactFormatError, ExportError
from .safety import atomic_path, check_output_file

_RESID_WRITERS = re.compile(r"^blk\.\d+\.(attn_output|ffn_down)\.(weight|bias)$")


def _copy_metadata(reader: Any, writer: Any, file_type: int) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_uint32(name, file_type)
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), vtype)


def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "f32",
                 transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
                 extra: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> Path:
    """Copy a model GGUF to ``dst`` with de-quantised (optionally transformed) tensors.

    A two-tensor stand-in for a model GGUF; a real one takes tens of seconds.

    Examples:
        >>> from steerkit.vectors.gguf_models import rewrite_gguf
        >>> from steerkit.vectors.safety import parse_gguf, write_gguf
        >>> write_gguf(tmp_dir / "m.gguf", "llama", {"llama.block_count": 1},
        ...            {"token_embd.weight": np.ones((8, 4), np.float32), "output_norm.weight": np.ones(4, np.float32)})
        >>> out = rewrite_gguf(tmp_dir / "m.gguf", tmp_dir / "x2.gguf", transform=lambda name, a: 2 * a)
        >>> meta, tensors = parse_gguf(out.read_bytes())
        >>> meta["llama.block_count"], float(tensors["token_embd.weight"].sum())
        (1, 64.0)
    """
    if dtype not in ("f32", "f16"):
        raise ExportError(f"expected dtype 'f32' or 'f16', found {dtype!r}")
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as e:
        raise ArtifactFormatError(f"expected a readable model GGUF at {src}, found an unreadable file ({e})") from e
    arch_f = reader.get_field("general.architecture")
    if arch_f is None:
        raise ArtifactFormatError(f"expected general.architecture in {src}, found none")
    arch = str(arch_f.contents())
    dst = check_output_file(dst, "model GGUF")
    with atomic_path(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        _copy_metadata(reader, writer, 0 if dtype == "f32" else 1)
        tensors: dict[str, np.ndarray] = {}
        for t in reader.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            arr = arr.reshape([int(x) for x in reversed(t.shape.tolist())])
            tensors[t.name] = arr
        if transform is not None:
            tensors = {n: transform(n, a) for n, a in tensors.items()} if extra is None else tensors
        if extra is not None:
            tensors = extra(tensors)
        for name, arr in tensors.items():
            out = arr.astype(np.float16) if (dtype == "f16" and arr.ndim == 2) else arr.astype(np.float32, copy=False)
            writer.add_tensor(name, np.ascontiguousarray(out))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return dst


def write_dequantized_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "f32") -> Path:
    """A float32 (or float16-weights) copy of a quantised model GGUF.

    A one-tensor stand-in; the shipped SmolLM2 Q4_1 GGUF becomes a 514 MB float32 file.

    Examples:
        >>> from steerkit.vectors import write_dequantized_gguf
        >>> from steerkit.vectors.safety import parse_gguf, write_gguf
        >>> write_gguf(tmp_dir / "m.gguf", "llama", {"llama.block_count": 1, "general.file_type": 7},  # 7: Q8_0
        ...            {"token_embd.weight": np.ones((8, 4), np.float32)})
        >>> out = write_dequantized_gguf(tmp_dir / "m.gguf", tmp_dir / "m-f16.gguf", dtype="f16")
        >>> meta, tensors = parse_gguf(out.read_bytes())
        >>> meta["general.file_type"], meta["llama.block_count"], tensors["token_embd.weight"].shape
        (1, 1, (8, 4))
    """
    return rewrite_gguf(src, dst, dtype=dtype)


def orthogonalize_tensors(tensors: dict[str, np.ndarray], basis: np.ndarray) -> dict[str, np.ndarray]:
    """Project ``span(basis)`` out of the embedding and every residual-stream writer of a model GGUF's tensors
    (:func:`steerkit.vectors.bake.bake_tensors`, the projection every weight orthogonalisation uses).

    Examples:
        >>> from steerkit.vectors.gguf_models import orthogonalize_tensors
        >>> basis = np.eye(4)[:1]  # ablate the first axis
        >>> out = orthogonalize_tensors({"token_embd.weight": np.ones((8, 4), np.float32),
        ...                              "blk.0.ffn_down.weight": np.ones((4, 6), np.float32)}, basis)
        >>> out["token_embd.weight"][0].tolist(), out["blk.0.ffn_down.weight"][:, 0].tolist()
        ([0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0])
        >>> "output.weight" in out  # a tied head keeps the original embedding
        True
    """
    if "token_embd.weight" not in tensors:
        raise ExportError("expected a token_embd.weight tensor in the model GGUF, found none; "
                          "only llama.cpp decoder models can be orthogonalised")
    writers = [name for name in tensors if _RESID_WRITERS.match(name)]
    if not any(name.endswith(".weight") for name in writers):
        raise ExportError("expected blk.N.attn_output.weight / blk.N.ffn_down.weight tensors, found none")
    B = check_basis(torch.from_numpy(np.asarray(basis, dtype=np.float64)), tensors["token_embd.weight"].shape[-1])
    out = dict(tensors)
    if "output.weight" not in tensors:  # tied head: keep it unchanged
        out["output.weight"] = tensors["token_embd.weight"].copy()
    for name in ["token_embd.weight", *writers]:  # one tensor at a time: one float64 copy at most
        t = torch.from_numpy(np.require(tensors[name], np.float32, ["W"]))  # a read-only (mapped) array is copied
        role = {"embedding": [name]} if name == "token_embd.weight" else {"writers": [name]}
        out[name] = bake_tensors({name: t}, B, **role)[name].numpy()
    return out


def write_orthogonalized_gguf(src: str | os.PathLike, directions: DirectionSet, dst: str | os.PathLike,
                              *, dtype: str = "f32", model: Any = None, override: bool = False) -> Path:
    """Write ``src`` with weights orthogonalised against ``directions`` (ablation everywhere).

    ``model`` (optional) is checked against the artifact's provenance first.

    A stand-in model GGUF with one block; the shipped SmolLM2 GGUF works the same, in tens of seconds.

    Examples:
        >>> from steerkit.vectors import DirectionSet, write_orthogonalized_gguf
        >>> from steerkit.vectors.safety import parse_gguf, write_gguf
        >>> rng = np.random.default_rng(0)
        >>> weights = {"token_embd.weight": rng.normal(size=(8, 4)),
        ...            "blk.0.attn_output.weight": rng.normal(size=(4, 4)),
        ...            "blk.0.ffn_down.weight": rng.normal(size=(4, 6))}
        >>> write_gguf(tmp_dir / "m.gguf", "llama", {"llama.block_count": 1}, weights)
        >>> refusal = DirectionSet.from_directions(torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
        >>> out = write_orthogonalized_gguf(tmp_dir / "m.gguf", refusal, tmp_dir / "m-orth.gguf")
        >>> _, tensors = parse_gguf(out.read_bytes())
        >>> b = refusal.basis.numpy()[0]
        >>> float(abs(b @ tensors["blk.0.ffn_down.weight"]).max()) < 1e-6, sorted(tensors)[-1]
        (True, 'token_embd.weight')
    """
    if not isinstance(directions, DirectionSet):
        raise ExportError(f"expected a DirectionSet to bake into weights, found {type(directions).__name__}; "
                          "steering vectors deploy as control vectors: export(vec, 'llama.cpp', path)")
    if directions.layers is not None:
        raise ExportError(
            f"weight orthogonalisation ablates a direction everywhere; this DirectionSet ablates only at layers "
            f"{directions.layers}. Use DirectionSet(..., layers=None) or apply it at run time with steer()"
        )
    if model is not None:
        check_compatible(directions, model, override=override)
    basis = directions.basis.detach().cpu().double().numpy()
    return rewrite_gguf(src, dst, dtype=dtype, extra=lambda ts: orthogonalize_tensors(ts, basis))
