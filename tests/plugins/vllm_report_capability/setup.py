# SPDX-License-Identifier: Apache-2.0
from setuptools import setup

setup(
    name="vllm_report_capability",
    version="0.1",
    packages=["vllm_report_capability"],
    entry_points={
        "vllm.general_plugins": ["report_capability = vllm_report_capability:register"],
    },
)
