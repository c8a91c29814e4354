"""Planner studies: per-step planning cost as the running requests grow (``scaling``, on the
scenario of ``scenarios``), the hot paths under pytest-benchmark (``micro``), a 100,000-step soak
(``soak``) and the mid-chain hole the re-store design closes (``hole_demo``)."""
