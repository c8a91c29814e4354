"""Triton copy kernels and their torch references (imported as ``kvtriton.kernels``).

- ``copy_blocks``: the one-launch store (gather into the CPU pool) and load (scatter into GPU
  blocks) kernel and its validating launcher (its table, ``CopyTable``, and the pair check,
  ``validate_pairs``, live in ``pairs``: every backend of ``kvtriton.engine`` uses them);
- ``pairs``: a step's copy pairs and the table they are checked against;
- ``reference``: pure-torch references (vectorized, and a per-block loop) used by the engine's
  ``backend="torch"``, the tests and the benchmark;
- ``compiled``: the kernel compiled ahead of time for sm_90 / sm_80 without a GPU, and the
  registers, spills and instructions read from the artifact
  (``python -m kvtriton.kernels.compiled``).

Set ``TRITON_INTERPRET=1`` before importing ``copy_blocks`` to run the kernel on CPU tensors.
"""
