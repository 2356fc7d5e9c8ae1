"""The local actuator: the `tandem up` launcher that started the planner scales its own
decode and prefill workers (services/launcher/control.py serves the endpoint; the
supervisor starts replicas in free slots and drains surplus ones)."""

from __future__ import annotations

import httpx

from services.planner.decision import Split

_TIMEOUT_S = 5.0


class ControlEndpointError(RuntimeError):
    """The launcher refused the call (its answer is the message) or did not answer."""


class LocalActuator:
    def __init__(self, port: int, token: str, http: httpx.AsyncClient | None = None) -> None:
        self._url = f"http://127.0.0.1:{port}/split"
        self._headers = {"Authorization": f"Bearer {token}"}
        self._http = http if http is not None else httpx.AsyncClient(timeout=_TIMEOUT_S)

    async def _call(self, method: str, body: dict[str, int] | None = None) -> Split:
        try:
            r = await self._http.request(method, self._url, headers=self._headers, json=body)
        except httpx.HTTPError as e:
            raise ControlEndpointError(f"the launcher's control endpoint {self._url}: {e}") from None
        if r.status_code >= 300:
            try:
                why = r.json().get("error", r.text)
            except ValueError:
                why = r.text
            raise ControlEndpointError(f"the launcher answered {r.status_code}: {why}")
        return Split.from_json(r.json())

    async def current(self) -> Split:
        return await self._call("GET")

    async def apply(self, desired: Split) -> None:
        await self._call("POST", desired.to_json())

    async def close(self) -> None:
        await self._http.aclose()
