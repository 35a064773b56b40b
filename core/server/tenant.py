"""Which tenant a request belongs to: the API key it came with, hashed.

Proposers that learn from finished requests (``suffix``'s response tree) can keep tenants
apart (``ProposalRequest.tenant``). The id is a hash of the bearer token, so that the key
itself never reaches a proposer, a log or a plugin. A request without a token has no tenant
(None): those share one. Without ``--api-key`` the server checks no token, so the id only
separates clients that send different tokens; with keys, a tenant is the holder of a key.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from starlette.requests import Request

_BEARER = "bearer "


def tenant_of(request: Request) -> Optional[str]:
    """``key-<16 hex digits of sha256(token)>`` for ``Authorization: Bearer <token>``, else None."""
    header = request.headers.get("authorization", "")
    if not header[: len(_BEARER)].lower() == _BEARER or not header[len(_BEARER):].strip():
        return None
    return "key-" + hashlib.sha256(header[len(_BEARER):].strip().encode()).hexdigest()[:16]
