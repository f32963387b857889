# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The overlay's switches as vLLM environment variables.

vLLM keys its torch.compile cache on the environment variables it knows
(`envs.compile_factors`), and `--fail-on-environ-validation` refuses `VLLM_` names it
does not know. A switch that changes what a traced graph computes or reads must be one
of them: the modules that read switches (the indexer key cache's in
`triton_indexer_logits.py`, the GGUF plugin's `gguf_kernels.py`) register theirs here.
This module imports nothing of the plugin.
"""

from collections.abc import Callable, Mapping


def register_switches(switches: Mapping[str, Callable[[], object]]) -> None:
    """Each switch, by name, as a vLLM environment variable whose value is its
    function's; a name vLLM (or an earlier call) has already keeps its entry."""
    from vllm import envs

    for name, value in switches.items():
        envs.environment_variables.setdefault(name, value)
