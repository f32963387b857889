# SPDX-License-Identifier: Apache-2.0
"""One launch of the sparse MLA gather kernel at a benchmark shape, for a profiler:

    ncu -k regex:_sparse_mla_kernel -c 1 --section WarpStateStats ... \
        python -m benchmarks.kernels.sparse_mla_one_launch TOKENS HEADS {bf16,fp8}

bf16 queries, topk 2048, a 262,144-token pool, random slots per token, the launch
table's configuration for the device. On Hopper, 64-head tiles run the
warp-specialized kernel: profile it with `-k regex:_sparse_mla_ws_kernel`.
"""

import math
import sys

import torch

from vllm.v1.attention.ops import triton_sparse_mla as tsm

T, H, kv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dev, pool, topk = "cuda", 262144, 2048
kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
cache = (torch.randn(pool // 64, 64, 576, device=dev) * 0.5).to(kv_dtype)
q = torch.randn(T, H, 576, device=dev, dtype=torch.bfloat16)
slots = torch.randint(0, pool, (T, topk), device=dev, dtype=torch.int32)
valid = torch.full((T,), topk, dtype=torch.int32, device=dev)
o = tsm.sparse_mla_attention(q, cache, slots, valid, 512, 1 / math.sqrt(256),
                             torch.ones(1, device=dev))
torch.cuda.synchronize()
print("ok", tuple(o.shape))
