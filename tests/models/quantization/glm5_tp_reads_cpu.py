# SPDX-License-Identifier: Apache-2.0
"""One tensor-parallel rank of vLLM's GlmMoeDsaForCausalLM filled on CPU from a
glm-dsa GGUF by the GGUF plugin's loader (glm5_vllm_cpu.build), counting the bytes
of the file the rank copies out of its mapping, tensor by tensor.

    python -m tests.models.quantization.glm5_tp_reads_cpu FILE.gguf --tp N --rank R \
        --port P --out READS.pt

Run one process per rank (gloo process groups over 127.0.0.1:P). A read is counted
where a tensor's bytes leave the file's mapping:
- every torch operation that is not a view (clone, copy_, to, cat, float...) with an
  input tensor inside the mapping counts that input's bytes (a TorchDispatchMode);
- gguf-py's dequantize (the adapter's dequantized targets) counts its input's bytes
  where that array is inside the mapping.
Views (narrow, reshape, select) read nothing. The count is deterministic: it is what
the loaders ask to copy, not what the kernel pages in.

Writes to --out {GGUF tensor name: (bytes counted, the tensor's bytes read as
np.packbits of a bool mask, the tensor's size)}, "__copies__": [the names of
the data tensors the adapter yielded as copies, not views of the file] (of the
tensors it does not dequantize), and "__resident__": the bytes of the file's
mappings resident in this process (/proc/self/smaps) before the first data tensor,
after each one was loaded, and at the end of the load.
"""

import argparse
import bisect
import sys

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FileReads:
    """The bytes read out of the mappings of GGUF `readers`, by tensor."""

    def __init__(self, readers):
        self.spans = []  # (start address, end address, name)
        for reader in readers:
            base = reader.data.ctypes.data
            for t in reader.tensors:
                start = base + int(t.data_offset)
                self.spans.append((start, start + int(t.n_bytes), t.name))
        self.spans.sort()
        self.starts = [s[0] for s in self.spans]
        self.counts = {s[2]: 0 for s in self.spans}
        self.masks = {s[2]: np.zeros(s[1] - s[0], dtype=bool) for s in self.spans}

    def find(self, t: torch.Tensor):
        """(start address, end address, name) of the GGUF tensor holding `t`'s data."""
        if t.device.type != "cpu" or t.numel() == 0:
            return None
        i = bisect.bisect_right(self.starts, t.data_ptr()) - 1
        if i >= 0 and t.data_ptr() < self.spans[i][1]:
            return self.spans[i]
        return None

    def read(self, t: torch.Tensor) -> None:
        """`t`, a view inside a mapping or not, is read whole."""
        span = self.find(t)
        if span is None:
            return
        start, end, name = span
        e = t.element_size()
        offset = t.data_ptr() - start
        assert offset % e == 0, (name, offset, e)
        # t's bytes in the tensor's mask: the mask viewed with t's strides
        mask = self.masks[name][offset:]
        np.lib.stride_tricks.as_strided(
            mask, (*t.shape, e), (*(s * e for s in t.stride()), 1), writeable=True)[...] = True
        self.counts[name] += t.numel() * e


def resident_bytes(paths) -> int:
    """The bytes of the files `paths` mapped into this process that are resident
    (the Rss of their mappings in /proc/self/smaps)."""
    names = {str(p.resolve()) for p in paths}
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] in names
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


class CountReads(TorchDispatchMode):
    def __init__(self, reads: FileReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func._schema.name not in ("aten::detach", "aten::alias"):
            inputs = list(args)
            if func._schema.name == "aten::copy_":
                inputs = inputs[1:]  # copy_(dst, src) reads src
            for t in tree_leaves((inputs, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.reads.read(t)
        return func(*args, **kwargs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import gguf
    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    from tests.models.quantization import glm5_vllm_cpu as cpu
    from vllm_gguf_plugin.gguf_model import open_gguf, split_files
    from vllm_gguf_plugin.weights_adapter import glm_dsa

    load_general_plugins()
    cpu.stub_device_selection()
    config = cpu.cpu_config(cpu.model_config(args.gguf, "bfloat16"))
    config.parallel_config.tensor_parallel_size = args.tp
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=args.tp, rank=args.rank, local_rank=args.rank,
                                     backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{args.port}")
        initialize_model_parallel(args.tp, 1)

    reads = FileReads([open_gguf(f) for f in split_files(args.gguf)])
    dequantize = gguf.quants.dequantize

    def counted_dequantize(data, qtype):
        reads.read(torch.from_numpy(np.asarray(data)))
        return dequantize(data, qtype)

    copies, resident = [], {"before": None, "loaded": [], "end": None}
    weights = glm_dsa.GlmDsaGGUF.weights
    paths = split_files(args.gguf)

    def checked_weights(self):
        made = {hf for hf, _, _ in self.defaults.values()}  # optional tensors' fills
        for name, t in weights(self):
            data = not name.endswith(".qweight_type")
            if data and resident["before"] is None:
                resident["before"] = resident_bytes(paths)
            stored = name.endswith(".qweight") or not (
                not data or name in made or self._dequantized_target(name))
            if stored and reads.find(t) is None:
                copies.append(name)
            yield name, t
            if data:
                resident["loaded"].append(resident_bytes(paths))

    gguf.quants.dequantize = counted_dequantize
    glm_dsa.GlmDsaGGUF.weights = checked_weights
    with CountReads(reads):
        cpu.build(args.gguf)
    resident["end"] = resident_bytes(paths)
    torch.save({**{n: (reads.counts[n], np.packbits(reads.masks[n]), reads.masks[n].size)
                   for n in reads.counts},
                "__copies__": copies, "__resident__": resident}, args.out)


if __name__ == "__main__":
    sys.exit(main())
