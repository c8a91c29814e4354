"""kvtriton's benchmark harness: ``python -m bench`` runs it; results go to ``bench/results/``.

Without CUDA the Triton kernels run in the interpreter on CPU tensors; that has to be decided
before any kernel module is imported, hence here, for every ``python -m bench.<part>``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
