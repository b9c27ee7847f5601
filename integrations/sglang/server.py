"""A running SGLang server behind capture's transport seam (capture.Transport): what slime and miles talk to.

Plain HTTP from the standard library (no sglang import: the client runs wherever the trainer does):
`POST /generate` with the capture flags (request.py), `GET /model_info` for the served model's path
(its `config.json` gives the geometry, or pass `model=` a checkpoint directory or config dict when the
server's path is not readable here), `GET /server_info` for SGLang's version and dtype.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ...geometry import EngineInfo
from ...models.layout import read_config
from .errors import SglangRequestError


class HttpTransport:
    """Capture's link to one SGLang HTTP server (`python -m sglang.launch_server ... --enable-return-routed-experts`)."""

    def __init__(self, url: str, *, model: Any = None, timeout_s: float = 600.0) -> None:
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self.where = f"the SGLang server at {self.url}"

    def call(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        """GET (payload None) or POST JSON to `path`; the decoded JSON reply, or SglangRequestError naming it."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SglangRequestError(f"{self.where}: {path} answered {e.code}: {e.read()[:2000].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise SglangRequestError(f"{self.where}: {path} could not be reached ({e})") from None

    def generate(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.call("/generate", fields)
        return out if isinstance(out, list) else [out]

    def model_config(self) -> Any:
        if self.model is not None:
            return self.model if isinstance(self.model, dict) else read_config(self.model)
        path = self.call("/model_info")["model_path"]
        try:
            return read_config(path)
        except FileNotFoundError as e:
            raise SglangRequestError(f"{self.where} serves {path!r}, whose config.json is not readable here ({e}); "
                                     "pass model= (a checkpoint directory or its config dict)") from None

    def radix_cache_disabled(self) -> bool:
        return bool(self.call("/server_info").get("disable_radix_cache"))

    def engine_info(self) -> EngineInfo:
        info = self.call("/server_info")
        return EngineInfo(name="sglang", version=str(info.get("version", "")), dtype=str(info.get("dtype", "")),
                          extra={"model": str(info.get("model_path", "")), "front_end": "server"})
