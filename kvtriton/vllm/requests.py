"""A vLLM ``Request`` as the planner sees it: dense keys for every position it may ever have.

``lookup_request`` builds a throwaway planner ``Request`` for a lookup (the keys of the hashes
that exist now). ``RequestMirror`` is the planner's view of an admitted request: its key array
covers ``prompt + max_tokens`` tokens (capped at the model length), the positions vLLM has not
hashed yet holding reserved ids (``kvtriton.vllm.keys``), bound as vLLM hashes them; its counters
are read from vLLM's request whenever the planner reads them (``LiveRequest``), so a step copies
nothing per running request.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtriton.records import Request
from kvtriton.vllm.keys import KeyIds

__all__ = ["LiveRequest", "RequestMirror", "lookup_request"]


def _known_keys(keys: KeyIds, suffixes: list[bytes], block_hashes: list[bytes], n: int,
                out: np.ndarray) -> None:
    id_of = keys.id_of
    for g, sfx in enumerate(suffixes):
        row = out[g]
        for j in range(n):
            row[j] = id_of(block_hashes[j] + sfx)


def _lora_id(vreq: Any) -> int | None:
    lora = getattr(vreq, "lora_request", None)
    return None if lora is None else lora.adapter_id


def lookup_request(vreq: Any, keys: KeyIds, suffixes: list[bytes]) -> Request:
    """A planner ``Request`` with the keys of ``vreq``'s current block hashes."""
    hashes = vreq.block_hashes
    n = len(hashes)
    arr = np.empty((len(suffixes), n), dtype=np.int64)
    _known_keys(keys, suffixes, hashes, n, arr)
    return Request(vreq.request_id, arr, num_prompt_tokens=vreq.num_prompt_tokens,
                   num_tokens=vreq.num_tokens, num_computed_tokens=vreq.num_computed_tokens,
                   num_output_placeholders=vreq.num_output_placeholders,
                   lora_id=_lora_id(vreq))


class LiveRequest(Request):
    """A planner ``Request`` whose token counters are those of the vLLM request ``vreq`` at the
    moment they are read (``num_tokens`` at least the prompt, as the planner expects). Keys,
    id, prompt length and LoRA are fixed at construction, and checked as ``Request`` checks
    them."""

    __slots__ = ("vreq",)

    def __init__(self, vreq: Any, keys: np.ndarray) -> None:
        self.vreq = vreq
        self.request_id = vreq.request_id
        self.keys = keys
        self.num_prompt_tokens = vreq.num_prompt_tokens
        self.lora_id = _lora_id(vreq)
        self.__post_init__()

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return max(self.vreq.num_tokens, self.num_prompt_tokens)

    @property
    def num_computed_tokens(self) -> int:  # type: ignore[override]
        return self.vreq.num_computed_tokens

    @property
    def num_output_placeholders(self) -> int:  # type: ignore[override]
        return self.vreq.num_output_placeholders

    @property
    def confirmed_tokens(self) -> int:  # type: ignore[override]
        v = self.vreq  # one read of the vLLM request for both counters
        return v.num_computed_tokens - v.num_output_placeholders


class RequestMirror:
    """The planner's ``Request`` for an admitted vLLM request, and its reserved ids.

    ``max_tokens``: the most tokens the request may reach (prompt plus ``max_tokens``, capped at
    the model length); positions past vLLM's current hashes get reserved ids.
    """

    __slots__ = ("_keys", "_released", "_suffixes", "bound", "req", "unbound")

    def __init__(self, vreq: Any, keys: KeyIds, suffixes: list[bytes], max_tokens: int,
                 hash_block_size: int) -> None:
        hashes = vreq.block_hashes
        known = len(hashes)
        n = max(known, max_tokens // hash_block_size)
        arr = np.empty((len(suffixes), n), dtype=np.int64)
        _known_keys(keys, suffixes, hashes, known, arr)
        if n > known:
            arr[:, known:] = keys.reserve(len(suffixes) * (n - known)).reshape(
                len(suffixes), n - known)
        self.req = LiveRequest(vreq, arr)
        self._keys = keys
        self._suffixes = suffixes
        self.bound = known  # hash positions whose keys are final
        self.unbound: list[int] = []  # reserved ids a collision left unbound
        self._released = False

    def bind(self) -> None:
        """Bind the reserved ids of the hashes vLLM made since the last call."""
        hashes = self.vreq.block_hashes
        n = min(len(hashes), self.req.keys.shape[1])
        if n <= self.bound:
            return
        keys, arr = self._keys, self.req.keys
        for j in range(self.bound, n):
            h = hashes[j]
            for g, sfx in enumerate(self._suffixes):
                kid = int(arr[g, j])
                if not keys.bind(h + sfx, kid):
                    # Another request made these tokens first: its id is the key; this
                    # request's reserved one never will be (see kvtriton.vllm.keys).
                    self.unbound.append(kid)
        self.bound = n

    @property
    def vreq(self) -> Any:
        """The vLLM request (vLLM may hand over a new object for the same id)."""
        return self.req.vreq

    @vreq.setter
    def vreq(self, vreq: Any) -> None:
        self.req.vreq = vreq

    def refresh(self) -> None:
        """Bind the hashes vLLM made since the last bind (the counters need no copy)."""
        if len(self.req.vreq.block_hashes) > self.bound:  # else bind() has nothing to bind
            self.bind()

    def release(self) -> None:
        """Recycle the ids that were never bound; once, after the planner released the row."""
        if self._released:
            return
        self._released = True
        self._keys.release(self.req.keys[:, self.bound:].ravel())
        self._keys.release(self.unbound)
