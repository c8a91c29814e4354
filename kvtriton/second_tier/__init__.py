"""A second tier under the CPU tier: KV blocks in Mooncake Store, shared by every replica.

The CPU tier (``kvtriton.vllm``) writes every block it stores through to the store and, when a
lookup's CPU hit ends, continues the prefix into the store with one batched existence query; the
blocks found there are fetched into the CPU tier's own pool, verified, and then loaded to the GPU
by the CPU tier's load path. Modules:

- ``config``: the ``"second_tier"`` object of ``kv_connector_extra_config`` (Mooncake's names);
- ``naming``: content-addressed object names (a block's chained hash and a fingerprint of all
  that makes its bytes differ);
- ``objects``: an object's 64-byte header (its name's digest, length, checksum) and its check;
- ``client``: Mooncake's client, with every failure mapped to a ``Fault`` kind, puts that
  tell a name another writer holds first from a stored one, and the start-up check that the
  store holds any memory;
- ``faults``: counting faults, warning once per kind and saying when the store is back;
- ``fetches``: the scheduler's part (existence queries, fetches into the CPU tier);
- ``worker_io``: a worker's part (write-through puts and fetches, on a background thread);
- ``local_master``: a master (and a store host) on loopback, for tests and benchmarks.

Nothing here imports vLLM; ``client`` imports Mooncake only when a client is made.
"""

from kvtriton.second_tier.config import SecondTierConfig, parse_second_tier

__all__ = ["SecondTierConfig", "parse_second_tier"]
