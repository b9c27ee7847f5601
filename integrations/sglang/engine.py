"""The in-process `sglang.Engine` behind capture's transport seam (capture.Transport).

A request goes through the engine's tokenizer manager as a `GenerateReqInput` (what `Engine.generate`
builds, whose signature has no `return_sampling_mask`), on the engine's own event loop.
"""

from __future__ import annotations

from typing import Any

from ...geometry import EngineInfo
from .errors import SglangRequestError


class EngineTransport:
    """Capture's link to one `sglang.Engine` in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.where = f"sglang.Engine({engine.server_args.model_path!r})"

    def generate(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(**fields)
        try:
            out = self.engine.loop.run_until_complete(self.engine.tokenizer_manager.generate_request(obj, None).__anext__())
        except Exception as e:  # SGLang's own refusals: ValueError from its checks, HTTPException from its manager
            if isinstance(e, ValueError) or hasattr(e, "status_code"):
                raise SglangRequestError(f"{self.where} refused the request: {type(e).__name__}: {e}") from e
            raise
        return out if isinstance(out, list) else [out]

    def model_config(self) -> Any:
        return self.engine.tokenizer_manager.model_config.hf_config

    def radix_cache_disabled(self) -> bool:
        return bool(self.engine.server_args.disable_radix_cache)

    def engine_info(self) -> EngineInfo:
        import sglang

        mc = self.engine.tokenizer_manager.model_config
        return EngineInfo(name="sglang", version=sglang.__version__, dtype=str(mc.dtype).removeprefix("torch."),
                          extra={"model": str(self.engine.server_args.model_path), "front_end": "engine"})
