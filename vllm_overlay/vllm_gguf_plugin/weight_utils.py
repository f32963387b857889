# SPDX-License-Identifier: Apache-2.0

import os  # overlay: glob and itertools no longer used (download_gguf)
from collections.abc import Generator
from pathlib import Path

import numpy as np  # overlay: gguf-py's reader no longer used (open_gguf)
import torch
from huggingface_hub import snapshot_download
from vllm.logger import init_logger

from .gguf_model.files import quant_files  # overlay: exact quant names (download_gguf)
from .gguf_model.reader import open_gguf  # overlay: every GGUF through the checked reader
from .gguf_model.tensors import LoadProgress, bf16_view, file_view  # overlay: views, progress

logger = init_logger(__name__)


def download_gguf(
    repo_id: str,
    quant_type: str,
    cache_dir: str | None = None,
    revision: str | None = None,
    ignore_patterns: str | list[str] | None = None,
    first_part_only: bool = False,  # overlay: a config needs only the first part
) -> str:
    """Download the GGUF model of `quant_type` from `repo_id` (every split part, or
    just the first) and return its (first) file. Offline, the cached snapshot."""
    # overlay: the quant's files by exact name (quant_files), not by globs
    from vllm.transformers_utils.repo_utils import list_repo_files

    names = [n for n in list_repo_files(repo_id, revision=revision) if n.endswith(".gguf")]
    if names:
        files = quant_files(names, quant_type, repo_id)
        folder = snapshot_download(
            repo_id=repo_id,
            cache_dir=cache_dir,
            allow_patterns=files[:1] if first_part_only else files,
            revision=revision,
            ignore_patterns=ignore_patterns,
        )
    else:  # overlay: offline (or an empty listing), what the cache holds
        folder = snapshot_download(
            repo_id=repo_id,
            cache_dir=cache_dir,
            allow_patterns=["*.gguf"],
            revision=revision,
            ignore_patterns=ignore_patterns,
        )
        cached = [p.relative_to(folder).as_posix() for p in Path(folder).rglob("*.gguf")]
        files = quant_files(cached, quant_type, f"{repo_id} (cached in {folder})")
    return os.path.join(folder, files[0])  # overlay: the first part


def resolve_local_gguf(local_dir: str, quant_type: str) -> str:
    """Find a GGUF file matching *quant_type* in a local directory."""
    # overlay: by exact name, as download_gguf
    names = [p.relative_to(local_dir).as_posix() for p in Path(local_dir).rglob("*.gguf")]
    return os.path.join(local_dir, quant_files(names, quant_type, local_dir)[0])


def get_gguf_extra_tensor_names(
    gguf_file: str | Path, gguf_to_hf_name_map: dict[str, str]
) -> list[str]:
    reader = open_gguf(gguf_file)  # overlay: the checked reader
    expected_gguf_keys = set(gguf_to_hf_name_map.keys())
    exact_gguf_keys = {tensor.name for tensor in reader.tensors}
    extra_keys = expected_gguf_keys - exact_gguf_keys
    return [gguf_to_hf_name_map[key] for key in extra_keys]


def get_gguf_weight_type_map(
    gguf_file: str | Path, gguf_to_hf_name_map: dict[str, str]
) -> dict[str, str]:
    reader = open_gguf(gguf_file)  # overlay: the checked reader
    return {
        gguf_to_hf_name_map[tensor.name]: tensor.tensor_type.name
        for tensor in reader.tensors
        if tensor.name in gguf_to_hf_name_map
    }


def gguf_quant_weights_iterator(
    gguf_file: str | Path, gguf_to_hf_name_map: dict[str, str] | None
) -> Generator[tuple[str, torch.Tensor], None, None]:
    yield from gguf_quant_weights_iterator_multi([gguf_file], gguf_to_hf_name_map)


def gguf_quant_weights_iterator_multi(
    gguf_files: list[str], gguf_to_hf_name_map: dict[str, str] | None = None
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for all tensors in *gguf_files*.

    When *gguf_to_hf_name_map* is ``None``, raw GGUF tensor names are used
    directly (useful when a caller will apply a :class:`WeightsMapper`
    afterwards).  When a mapping is provided, tensors not present in the map
    are skipped and names are translated accordingly.
    """
    _QUANT_TYPES = ("F32", "BF16", "F16")

    # overlay: the loaded tensors, for the load's progress (rank 0)
    readers = [open_gguf(gguf_file) for gguf_file in gguf_files]
    progress = LoadProgress.of(
        t for r in readers for t in r.tensors
        if gguf_to_hf_name_map is None or t.name in gguf_to_hf_name_map)
    for reader in readers:  # overlay: the checked reader
        for tensor in reader.tensors:
            if gguf_to_hf_name_map is not None:
                if tensor.name not in gguf_to_hf_name_map:
                    continue
                name = gguf_to_hf_name_map[tensor.name]
            else:
                name = tensor.name

            weight_type = tensor.tensor_type
            if weight_type.name not in _QUANT_TYPES:
                yield name.replace("weight", "qweight_type"), torch.tensor(weight_type)
                name = name.replace("weight", "qweight")

            # overlay: views of the file's mapping, not copies: the loader narrows to
            # this rank's shard before it copies (gguf_model/tensors.py)
            weight = tensor.data
            if weight_type.name == "BF16" and weight.dtype == np.uint8:
                # overlay: a view; a copy where the byte order is swapped
                param = bf16_view(weight, byteswap=reader.byte_order == "S")
            else:
                param = file_view(weight)  # overlay: a view of the file, not a copy
            yield name, param
            progress.update(tensor)  # overlay: the load's progress
    progress.close()  # overlay: the load's progress


def get_gguf_unquantized_params(gguf_files: list[str]) -> list[str]:
    _QUANT_TYPES = ("F32", "BF16", "F16")
    return list(
        {
            tensor.name
            for gguf_file in gguf_files
            for tensor in open_gguf(gguf_file).tensors  # overlay: the checked reader
            if tensor.tensor_type.name in _QUANT_TYPES
        }
    )
    # for gguf_file in gguf_files:
    #     reader = gguf.GGUFReader(gguf_file)
    #     for tensor in reader.tensors:
    #         if tensor.tensor_type.name in unquant_types:
    #             yield tensor.name.rsplit(".", 1)[0]
