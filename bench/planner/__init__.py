"""Planner studies: per-step planning cost as the running requests grow (``scaling``, on the
scenario of ``scenarios``), the hot paths under pytest-benchmark (``micro``) and the mid-chain
hole the re-store design closes (``hole_demo``); the 100,000-step soak is
``bench.conformance.planner_soak``."""
