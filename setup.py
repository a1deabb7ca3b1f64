"""Packaging for npu_lossscale.

TensorFlow is deliberately not a hard requirement: Ascend and GPU hosts ship
their own TF 1.15 build. The package is not published on PyPI; from a
checkout, ``pip install '.[cpu]'`` installs it with a CPU TensorFlow for
development, and ``pip install .`` installs it alone. ``pip install '.[port]'``
adds libcst for ``python -m npu_lossscale.port``.
"""
from setuptools import find_packages, setup

setup(
    name="npu_lossscale",
    version="0.3.0",
    description=("One loss-scaled, overflow-checked update op for several TF1 "
                 "optimizers in one session.run (Ascend NPU, GPU, CPU)."),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["npu_lossscale", "npu_lossscale.*"]),
    python_requires=">=3.7",
    install_requires=["numpy"],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.15"],
        "examples": ["tqdm", "matplotlib", "scikit-learn"],
        # python -m npu_lossscale.port: libcst 1.0.1 runs on Python 3.7 to 3.11.
        "port": ["libcst==1.0.1"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
