"""Small shared security rules: what counts as loopback, and bearer-token checks."""

from __future__ import annotations

import hmac
import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_ok(authorization: str | None, token: str) -> bool:
    """Constant-time check of an `Authorization: Bearer <token>` header value (the scheme is
    case-insensitive, RFC 9110 §11.1)."""
    scheme, _, cred = (authorization or "").strip().partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(cred.strip().encode(), token.encode()) and ok_scheme


def admin_denied(
    host: str, token: str | None, authorization: str | None, what: str
) -> tuple[int, str] | None:
    """None when allowed; else (HTTP status, one-line reason).

    With a token, the request must carry it. Without one, the action is allowed only on a
    loopback listener (secure by default: nothing reachable from the network is unauthenticated).
    """
    if token is None:
        if is_loopback(host):
            return None
        return 403, f"{what} over the network needs a token"
    if not bearer_ok(authorization, token):
        return 401, f"{what} needs 'Authorization: Bearer <token>'"
    return None
