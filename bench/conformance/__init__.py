"""Conformance and robustness checks, apart from the measurements: kvtriton's scheduler side
beside vLLM's ``SimpleCPUOffloadScheduler`` step for step (``differential``, its connector
``differential_tee``, checks ``differential_checks``, models ``differential_models`` and planted
bugs ``differential_mutations``), the simulator beside vLLM's scheduler (``crosscheck``),
``reqlru`` and ``reqarc`` beside vLLM 0.33's own policy classes (``native_policies``), and the
soaks whose verdict is bounded memory: the planner's 100,000 steps (``planner_soak``) and the
connector's in vLLM's real scheduler (``connector_soak``, repeating ``connector_soak_run``).
``scheduler_driver`` steps a real vLLM ``Scheduler`` without a model, for the connector soak and
the tests."""
