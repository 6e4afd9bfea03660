"""The control API over HTTP, for tests and tools in another process than the emulator.

Same methods as the in-process `Emulator` handle; errors come back as `ControlError`
with the emulator's message. Every call needs the emulator's control token
(``emu.control_token``, or the ``control token:`` line `orchestrator emulator` prints);
``emu.control()`` gives a client that has it. Without it each call fails with
``ControlError(401, ...)``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class ControlError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"emulator control: {status}: {message}")


class ControlClient:
    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = token  # private, and out of any repr: it is a credential

    def __repr__(self) -> str:
        return f"ControlClient({self.url!r}, token={'<set>' if self._token else None})"

    def fail(self, method: str, kind: str, *, count: int = 1, zone: str | None = None) -> None:
        self._post("fail", {"method": method, "kind": kind, "count": count, "zone": zone})

    def random_errors(self, rate: float, *, codes: tuple[int, ...] = (503, 429), seed: int | None = None,
                      methods: tuple[str, ...] | None = None) -> None:
        self._post("random-errors", {"rate": rate, "codes": list(codes), "seed": seed,
                                     "methods": list(methods) if methods else None})

    def stockout(self, zone: str, *, accelerator_type: str | None = None, mode: str = "wait") -> None:
        self._post("stockout", {"zone": zone, "acceleratorType": accelerator_type, "mode": mode})

    def clear_stockout(self, zone: str | None = None) -> None:
        self._post("clear-stockout", {"zone": zone})

    def clear_faults(self) -> None:
        self._post("clear-faults", {})

    def reclaim(self, name: str) -> str:
        return self._post("reclaim", {"name": name})["name"]

    def terminate(self, name: str) -> str:
        return self._post("terminate", {"name": name})["name"]

    def power_off(self, name: str, *, host: int | None = None, silent: bool = False) -> str:
        return self._post("poweroff", {"name": name, "host": host, "silent": silent})["name"]

    def notice(self, name: str, *, host: int | None = None, event: str = "preempted") -> list[int]:
        return self._post("notice", {"name": name, "host": host, "event": event})["hosts"]

    def state(self) -> dict[str, Any]:
        return self._call("GET", "state", None)

    def requests(self) -> list[dict[str, Any]]:
        return self._call("GET", "requests", None)["requests"]

    def _post(self, what: str, args: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", what, args)

    def _call(self, verb: str, what: str, args: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(args).encode() if args is not None else None
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(f"{self.url}/_emulator/{what}", data=data, method=verb, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise ControlError(e.code, _error_message(e)) from None


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read() or b"{}")["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not the emulator's JSON error body
        return str(e)
