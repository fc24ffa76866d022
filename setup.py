"""Install torch_cubridge. The expert kernels in csrc/ ship inside the package as _csrc."""
import os
import re

import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(HERE, "torch_cubridge", "version.py")).read()).group(1)


class BuildWithKernels(build_py):
    """Copy csrc/ into the built package as torch_cubridge/_csrc (the JIT reads it there)."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "torch_cubridge", "_csrc")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(HERE, "csrc"), dst)


setup(
    name="torch_cubridge",
    version=VERSION,
    description="Attention written in PyTorch, compiled to a fused, verified CUDA kernel",
    packages=find_packages(include=["torch_cubridge", "torch_cubridge.*"]),
    cmdclass={"build_py": BuildWithKernels},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "transformers",
        "openai",
        "diskcache",
        "filelock>=3.20.3",
        "safetensors",
    ],
    # triton: its wheel carries cuobjdump; pytest-xdist: the suite in parallel, half the time on 2 cores
    extras_require={"test": ["pytest", "pytest-xdist", "triton"]},
    entry_points={"console_scripts": ["cubridge=torch_cubridge.cli:main"]},
)
