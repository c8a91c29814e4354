"""Kernel studies: the copy kernel's correctness against the torch reference (``check``) and
its bandwidth on a GPU (``bandwidth``)."""
