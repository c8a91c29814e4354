"""kvtriton's benchmark harness: ``python -m bench`` runs it; results go to ``bench/results/``."""
