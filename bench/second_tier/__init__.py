"""The second tier's benchmark (``python -m bench --only second_tier``): ``throughput`` (the
store's put and get beside memcpy, and the tier's own transfers beside the raw client) and
``replicas`` (two replicas sharing the store beside one serving both, in vLLM's engine)."""
