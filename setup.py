"""The packages, found from the tree so that a new subpackage ships without being listed (a hand
list once left out ``kvtriton.eviction``: the wheel imported nothing). kvtriton's own live under
``kvtriton/``; the kernels live in the top-level ``kernels/`` the layout asks for but import as
``kvtriton.kernels``, since a top-level ``kernels`` package is another PyPI project's name.
``[tool.setuptools.packages.find]`` names packages after their folders and cannot express that
mapping, hence this file; everything else is in pyproject.toml."""

from setuptools import find_packages, setup

KERNELS_DIR = "kernels"

packages = find_packages(include=["kvtriton", "kvtriton.*"])
packages += [f"kvtriton.{p}" for p in find_packages(include=[KERNELS_DIR, f"{KERNELS_DIR}.*"])]

setup(packages=packages, package_dir={"kvtriton.kernels": KERNELS_DIR})
