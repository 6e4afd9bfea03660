"""The control API over HTTP, for tests and tools in another process than the emulator.

Same methods as the in-process `Emulator` handle; errors come back as `ControlError`
with the emulator's message.
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
    def __init__(self, url: str, *, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

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

    def state(self) -> dict[str, Any]:
        return self._call("GET", "state", None)

    def requests(self) -> list[dict[str, Any]]:
        return self._call("GET", "requests", None)["requests"]

    def _post(self, what: str, args: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", what, args)

    def _call(self, verb: str, what: str, args: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(args).encode() if args is not None else None
        req = urllib.request.Request(f"{self.url}/_emulator/{what}", data=data, method=verb,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
            raise ControlError(e.code, body.get("error", {}).get("message", str(e))) from None
