"""Studies in vLLM's real engine and scheduler: the setups served by ``LLMEngine`` (``engine``),
the planner's cost beside vLLM's (``vs_vllm``) and one client claiming the protected segment with
every request (``claims_attack``). The checks against vLLM (the differential, the cross-check, the
native policies, the connector soak) are in ``bench.conformance``."""
