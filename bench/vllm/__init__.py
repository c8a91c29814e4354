"""Studies in vLLM's real engine and scheduler: the setups served by ``LLMEngine`` (``engine``),
the planner's cost beside vLLM's (``vs_vllm``), the connector's memory over a long run (``soak``),
the simulator beside vLLM's scheduler (``crosscheck``) and kvtriton's scheduler side beside vLLM's
own step for step (``differential``)."""
