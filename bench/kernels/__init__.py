"""Kernel studies: the copy kernel's correctness against the torch reference (``check``) and
its bandwidth on a GPU (``bandwidth``), with the helpers the latter runs on: the timing of a
shape (``timing``), the GEMM contention run (``contention``) and the targets' verdict
(``targets``)."""
