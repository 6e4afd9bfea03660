"""Who may use the dashboard: its token, and the session cookies and CSRF tokens derived from it."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

SESSION_S = 7 * 24 * 3600  # how long a session cookie lasts


class Auth:
    """The token, the session cookies and CSRF tokens derived from it (see `orchestrator.observe.dashboard.server`)."""

    def __init__(self, token: str):
        if len(token) < 16:
            raise ValueError("the dashboard's token is too short")
        self._token = token.encode()
        self._key = hmac.new(self._token, b"orchestrator dashboard", hashlib.sha256).digest()
        # One cookie name per token: cookies ignore the port, and two clusters on this machine
        # (two state directories) must not overwrite each other's session.
        self.cookie_name = "orchestrator_" + hmac.new(self._key, b"cookie name", hashlib.sha256).hexdigest()[:10]

    def token_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self._token)

    def new_session(self, now: float | None = None) -> str:
        nonce, issued = secrets.token_urlsafe(18), int(time.time() if now is None else now)
        return f"{nonce}.{issued}.{self._sign('session', nonce, str(issued))}"

    def session_nonce(self, value: str | None, now: float | None = None) -> str | None:
        """The nonce of a valid, unexpired session cookie value, else None."""
        if not value or value.count(".") != 2:
            return None
        nonce, issued, sig = value.split(".")
        if not hmac.compare_digest(sig, self._sign("session", nonce, issued)):
            return None
        try:
            age = (time.time() if now is None else now) - int(issued)
        except ValueError:
            return None
        return nonce if -60 <= age <= SESSION_S else None

    def csrf(self, nonce: str) -> str:
        return self._sign("csrf", nonce)

    def _sign(self, *parts: str) -> str:
        return hmac.new(self._key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()
