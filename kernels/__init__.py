"""Triton copy kernels and their torch references (imported as ``kvtriton.kernels``)."""
