"""Triton copy kernels and their torch references (imported as ``kvtriton.kernels``).

- ``copy_blocks``: the one-launch store (gather into the CPU pool) and load (scatter into GPU
  blocks) kernel, its tables (``CopyTable``) and its validating launcher;
- ``reference``: pure-torch references (vectorized, and a per-block loop) used by the engine's
  ``backend="torch"``, the tests and the benchmark.

Set ``TRITON_INTERPRET=1`` before importing ``copy_blocks`` to run the kernel on CPU tensors.
"""
