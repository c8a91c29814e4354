"""The paper: ``python paper/build.py`` regenerates ``paper.md`` from ``bench/results/``."""
