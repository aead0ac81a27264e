"""Hugging Face checkpoints in and out for Qwen3-MoE, Mixtral and OLMoE: ``load_hf``, ``load_hf_weights`` and
``save_hf``, on ``safetensors`` and transformers' config classes.

``load_hf`` reads a local HF directory (``config.json`` plus ``model.safetensors`` or the shards of
``model.safetensors.index.json``) into a ``GPTModel``; ``save_hf`` writes a directory that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. The config mapping is ``hf_config``, the tensor
mapping ``hf_weights``; docs/hf_interop.md states both. Nothing here downloads: pass a local directory.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard
from transformers import PretrainedConfig

from moe_core.config import TransformerConfig
from moe_core.interop.hf_config import (
    HF_CONFIG_CLASSES,
    config_from_hf,
    config_to_hf,
    model_identity,
    parse_hf_config,
)
from moe_core.interop.hf_files import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    listing,
    non_weight_files,
    read_json,
    staged,
    target_entries,
)
from moe_core.interop.hf_weights import (
    ExpertStack,
    SafetensorsReader,
    fill_rows,
    hf_directory,
    hf_shapes,
    hf_tensors,
    weight_map,
)
from moe_core.models.gpt import GPTModel
from moe_core.models.param_roles import expert_offset

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def hf_config_file(path: str | Path) -> Path:
    """The ``config.json`` of the HF directory ``path`` (or of the directory of the file ``path``).

    Raises:
        FileNotFoundError: there is none.
    """
    file = hf_directory(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"path: expected a Hugging Face directory with {CONFIG_FILE}, got {path}")
    return file


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of the HF directory ``path`` (or of the directory of the file ``path``) as a dict.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: it is not a JSON object (naming the file, line and column).
    """
    return read_json(hf_config_file(path))


def load_hf(path: str | Path, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
            ) -> tuple[TransformerConfig, GPTModel]:
    """Build the ``GPTModel`` of a local HF checkpoint directory and load its weights.

    The model is built on the meta device and allocated once in ``dtype`` on ``device``; the safetensors
    shards are then read tensor by tensor (expert by expert), so memory stays at about one copy of the model.

    Args:
        path: directory with ``config.json`` and the safetensors file(s) of a ``qwen3_moe``, ``mixtral`` or
            ``olmoe`` checkpoint, or a file in it.
        device: where the parameters live (default CPU).
        dtype: parameter dtype; default the checkpoint's ``dtype`` / ``torch_dtype``, else float32.
    Returns:
        ``(config, model)``; the model is in training mode, like a freshly built one.
    Raises:
        FileNotFoundError: no ``config.json`` or safetensors file.
        ValueError: a defective or unsupported config field (see ``hf_config.config_from_hf``), a ``dtype``
            that is no floating-point torch dtype, or tensors as ``load_hf_weights`` refuses them.
    """
    file = hf_config_file(path)
    raw = read_json(file)
    config = config_from_hf(raw, str(file))
    if dtype is None:
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{file}: dtype={name!r}: expected a floating-point torch dtype such as 'bfloat16'")
    model = build_empty_model(config, device=device, dtype=dtype)
    load_hf_weights(model, path)
    return config, model


def build_empty_model(config: TransformerConfig, pg_collection=None, *, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.float32) -> GPTModel:
    """A ``GPTModel`` (this EP rank's experts with ``pg_collection``) allocated in ``dtype`` on ``device``
    without initialising its weights (built on the meta device); its buffers start at zero, as in a fresh one.
    Fill it with ``load_hf_weights``."""
    with torch.device("meta"):
        model = GPTModel(config, pg_collection)
    model = model.to(dtype=dtype).to_empty(device=device or "cpu")
    with torch.no_grad():
        for buffer in model.buffers():  # every GPTModel buffer (router counters, expert bias) starts at zero
            buffer.zero_()
    return model


def load_hf_weights(model: torch.nn.Module, path: str | Path, pg_collection=None) -> dict[str, int]:
    """Copy an HF checkpoint's tensors into ``model``, reading on this rank only the tensors and rows it holds.

    ``model`` is a ``GPTModel`` (its ``config`` must match the checkpoint's), possibly holding only this EP
    rank's experts (``pg_collection``: ``ProcessGroupCollection.local_expert_indices``) and possibly wrapped
    with FSDP2 or replicate: a ``Shard(0)`` parameter reads its rows only, a ``Shard(1)`` one (a gated fc1
    weight, ``fsdp.fsdp_shard_placement``) its columns only, a ``Replicate`` one all of it. Not collective: every
    rank reads its own part. Not for tensor parallelism (2-D meshes raise).

    Returns:
        The elements read per HF tensor, ``{key: count}``.
    Raises:
        FileNotFoundError: no safetensors file, or a shard the index names is missing.
        ValueError: parameters without a mapping (e.g. ``moe_grouped_gemm=False``), tensors missing from or
            unexpected in the checkpoint, shapes that differ, a dtype that is not floating point, NaN or Inf in
            the rows this rank reads, a damaged file or index, an index entry that leads outside the directory
            (each named with its file), or an expert split other than ``pg_collection``'s.
    """
    config = model.config
    sources = weight_map(config)
    params = dict(model.named_parameters())
    if set(params) != set(sources):
        raise ValueError(f"model: parameters without a Hugging Face mapping {sorted(set(params) - set(sources))}, "
                         f"mapped names missing from the model {sorted(set(sources) - set(params))}")
    ep_size = 1 if pg_collection is None else pg_collection.ep_size
    offset = expert_offset(config, pg_collection)
    expected = hf_shapes(sources, {name: p.shape for name, p in params.items()})
    with SafetensorsReader(path) as reader:
        _check_tensors(expected, reader)
        for name, param in params.items():
            local, start, column = _held_block(name, param)
            src = sources[name]
            if isinstance(src, ExpertStack):
                if param.shape[0] * ep_size != src.num_experts:
                    raise ValueError(f"{name}: expected {src.num_experts} / EP {ep_size} experts, "
                                     f"got {param.shape[0]}")
                start += offset
            fill_rows(local, src, reader, start, column)
        return dict(reader.elements_read)


def _check_tensors(expected: dict[str, tuple[int, ...]], reader: SafetensorsReader) -> None:
    missing = sorted(set(expected) - set(reader.files))
    unexpected = sorted(set(reader.files) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint: tensors missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for key, shape in expected.items():
        if reader.shape(key) != shape:
            raise ValueError(f"checkpoint: {key} has shape {reader.shape(key)}, the config implies {shape}")
        if not reader.dtype(key).startswith(("F", "BF")):  # safetensors' names: F32, BF16, F8_E4M3, I64, BOOL, ...
            raise ValueError(f"{reader.files[key]}: tensor {key} has dtype {reader.dtype(key)}; expected a "
                             "floating-point dtype (integer and boolean weights are not cast)")


def _held_block(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int, int | None]:
    """This rank's part of ``param`` (a tensor sharing its storage), the global row it starts at and, for a
    ``Shard(1)`` parameter, the global column (else None)."""
    if not isinstance(param, DTensor):
        return param.detach(), 0, None
    placements = param.placements
    local = param.to_local().detach()
    if param.device_mesh.ndim != 1 or not (placements[0].is_replicate() or placements[0] in (Shard(0), Shard(1))):
        raise ValueError(f"{name}: expected a 1-D mesh with Replicate, Shard(0) or Shard(1), got {placements}")
    if placements[0].is_replicate():
        return local, 0, None
    dim = placements[0].dim
    size = param.shape[dim]
    chunk = -(-size // param.device_mesh.size())  # torch.chunk's split, as FSDP2 shards
    start = min(param.device_mesh.get_local_rank() * chunk, size)
    if local.shape[dim] != min(chunk, size - start):
        raise ValueError(f"{name}: local shard of {local.shape[dim]} in dim {dim}, expected {min(chunk, size - start)}")
    return (local, start, None) if dim == 0 else (local, 0, start)


def save_hf(model: torch.nn.Module, config: TransformerConfig, out_dir: str | Path, *,
            max_shard_size: int | str = "5GB", reference: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (``config.json`` and safetensors shards).

    The inverse of ``load_hf``: one tensor per expert (the Hub's layout), the aux-loss coefficient converted
    back (``hf_config.aux_loss_coeff_to_hf``). Shards are written one at a time; more than one get
    ``model-0000i-of-0000n.safetensors`` names and an index, as ``save_pretrained`` does. The directory is
    built beside ``out_dir`` and renamed into place at the end (``hf_files``): a process killed while writing
    leaves ``out_dir`` as it was.

    Args:
        model: a single-process ``GPTModel`` of ``config`` with all experts (under EP or FSDP2, gather first:
            ``moe_core.models.full_state.gather_full_state_dict`` or a DCP checkpoint loaded in one process).
        config: its ``TransformerConfig``.
        out_dir: must not exist or be empty, unless ``overwrite``.
        max_shard_size: bytes per shard, an int or a string such as ``"5GB"`` or ``"500MiB"``.
        reference: the original HF directory: its token ids and ``max_position_embeddings`` are kept and its
            other files (tokenizer, generation config, model card; not weights) copied. It must describe the
            same model (``hf_config.model_identity``).
        overwrite: replace an ``out_dir`` that holds a Hugging Face checkpoint (``config.json`` and weights).
    Returns:
        ``out_dir`` as a Path.
    Raises:
        ValueError: a config field HF cannot hold (``hf_config.config_to_hf``), parameters that do not match
            ``config``, a bad ``max_shard_size``, or a ``reference`` of another model (naming the fields).
        TypeError: DTensor parameters (a wrapped model).
        FileExistsError: ``out_dir`` is not empty (without ``overwrite``), is a file, or is no HF checkpoint.
    """
    out = Path(out_dir)
    sources = weight_map(config)
    params = dict(model.named_parameters())
    if set(params) != set(sources):
        raise ValueError(f"model: parameters {sorted(set(params) ^ set(sources))} do not match config")
    for name, param in params.items():
        if isinstance(param, DTensor):
            raise TypeError(f"model: {name} is a DTensor; save a single-process model (gather the state first)")
        src = sources[name]
        if isinstance(src, ExpertStack) and param.shape[0] != src.num_experts:
            raise ValueError(f"model: {name} holds {param.shape[0]} of {src.num_experts} experts; gather them first")
    dtype = params["embedding.weight"].dtype
    reference_config = None if reference is None else read_hf_config(reference)
    hf_config = config_to_hf(config, reference_config, dtype=dtype)
    if reference is not None:
        _check_reference(hf_config_file(reference), reference_config, hf_config)
    limit = _parse_size(max_shard_size)
    _check_target(out, overwrite)
    sizes = {key: math.prod(shape) * params["embedding.weight"].element_size()
             for key, shape in hf_shapes(sources, {n: p.shape for n, p in params.items()}).items()}
    shard_of, shard, used = {}, 0, 0
    for key, nbytes in sizes.items():  # in writing order: a new shard when the next tensor would overflow
        if used and used + nbytes > limit:
            shard, used = shard + 1, 0
        shard_of[key], used = shard, used + nbytes
    count = shard + 1
    names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    with staged(out) as staging:
        pending: dict[str, torch.Tensor] = {}
        current = 0
        for name, src in sources.items():
            for key, tensor in hf_tensors(src, params[name].detach()):
                if shard_of[key] != current:
                    save_file(pending, staging / names[current], metadata={"format": "pt"})
                    pending, current = {}, shard_of[key]
                pending[key] = tensor.cpu()
        save_file(pending, staging / names[current], metadata={"format": "pt"})
        if count > 1:
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {key: names[shard] for key, shard in shard_of.items()}}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        hf_config.save_pretrained(staging)
        for file in non_weight_files(hf_directory(reference)) if reference is not None else ():
            shutil.copy2(file, staging / file.name)
    return out


def _check_reference(file: Path, raw: dict[str, Any], exported: PretrainedConfig) -> None:
    """Raise when the reference ``config.json`` describes another model than the exported config."""
    ours = model_identity(exported)
    arch = raw.get("model_type")
    supported = isinstance(arch, str) and arch in HF_CONFIG_CLASSES
    theirs = model_identity(parse_hf_config(raw, str(file))) if supported else {"model_type": arch}
    diffs = ", ".join(f"{k}: {v!r} there, {ours[k]!r} exported" for k, v in theirs.items() if v != ours[k])
    if diffs:
        raise ValueError(f"reference: {file} describes another model ({diffs}); pass the directory the model was "
                         "imported from")


def _check_target(out: Path, overwrite: bool) -> None:
    """Raise unless ``out`` is absent, an empty directory, or (``overwrite``) a Hugging Face checkpoint."""
    held = target_entries(out)
    if held and not overwrite:
        raise FileExistsError(f"out_dir: {out} already holds {listing(held)}; choose another directory, or pass "
                              "overwrite=True (export --overwrite) to replace an earlier export")
    if held and (CONFIG_FILE not in held or not (SINGLE_FILE in held or INDEX_FILE in held)):
        raise FileExistsError(f"out_dir: {out} holds {listing(held)}, not a Hugging Face checkpoint ({CONFIG_FILE} "
                              f"and {SINGLE_FILE} or {INDEX_FILE}); refusing to replace it")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", str(size).upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected a positive int or a size such as '5GB', got {size!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


__all__ = ["load_hf", "load_hf_weights", "build_empty_model", "save_hf", "read_hf_config", "hf_config_file"]
