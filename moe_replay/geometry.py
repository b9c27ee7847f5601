"""Model geometry and engine info: what a trace needs to be interpreted without the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from .errors import GeometryMismatchError, Where
from .noise import EngineNoise


def route_dtype(num_experts: int) -> np.dtype:
    """Narrowest unsigned dtype that holds every expert id (uint8 up to 256 experts)."""
    if num_experts <= 1 << 8:
        return np.dtype(np.uint8)
    if num_experts <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def token_dtype(vocab_size: int) -> np.dtype:
    """Narrowest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of the MoE model a trace was recorded on.

    Layer ids are global route-layer indices (invariant 2): a model whose first layers are dense
    has `moe_layer_ids` starting above 0, and routes column L=j belongs to layer moe_layer_ids[j].
    A route layer is a decoder layer where each decoder layer routes its tokens once (every engine-served
    family); a family that routes R > 1 times in each decoder layer (JetMoE: attention heads and MLP
    experts, R = 2) has R route layers per decoder layer, decoder_layer * R + slot
    (integrations/hf/routers.py route_layer; docs/trace.md).
    """

    num_layers: int
    """Route layers of the model, dense and MoE: its decoder layers times the routers each MoE layer holds (R,
    1 for most families)."""
    moe_layer_ids: tuple[int, ...]
    """Global indices of the MoE route layers, strictly increasing."""
    num_experts: int
    """Routed experts per MoE layer (shared experts are not routed and not counted)."""
    top_k: int
    """Experts chosen per token per MoE layer."""
    vocab_size: int
    """Size of the logits' last dimension (may exceed the tokenizer's vocabulary)."""
    family: str = ""
    """Model family name (the HF model_type, e.g. 'qwen3_moe'); "" = not known. Replay refuses a
    trace of another family: two families can share every shape and still route differently."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layer_ids", tuple(int(i) for i in self.moe_layer_ids))
        for name in ("num_layers", "num_experts", "top_k", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"ModelGeometry.{name} must be a positive int, got {value!r}")
        if not self.moe_layer_ids:
            raise ValueError("ModelGeometry.moe_layer_ids must name at least one MoE layer, got ()")
        ids = self.moe_layer_ids
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= self.num_layers:
            raise ValueError(
                f"ModelGeometry.moe_layer_ids must be strictly increasing in [0, {self.num_layers}), got {ids}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelGeometry.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def route_dtype(self) -> np.dtype:
        return route_dtype(self.num_experts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["moe_layer_ids"] = list(self.moe_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelGeometry":
        return cls(**d)

    def check_matches(self, other: "ModelGeometry", where: Where = Where(), what: str = "") -> None:
        """Raise GeometryMismatchError if `other` differs from this geometry in any field.

        The one check of "this model can take these traces": build_plan runs it per trace, and every
        replay or scoring entry runs it on the model's geometry against the plan's before any
        forward. `self` is the model's side (the error's expected), `other` the trace's or plan's
        (found); `what` (e.g. "model vs plan") names the two sides in the message. Names the first
        differing field.

        `family` is compared too: two families can share every shape and still be other models
        (other router weights, score functions, grouped top-k, correction biases), so a trace's
        expert ids replayed into a model of another family name other experts for most tokens, with
        no shape error to show it. An empty family is unknown and matches any, the other fields still
        equal: a geometry built by hand (tests, tools, Megatron's `model_geometry(model, family="")`)
        or a record from an engine whose config names no model_type has nothing to compare, and a
        known family that differs is still refused. build_plan closes the gap this leaves: its plan
        takes the family its traces name (`with_family_of`), so one batch cannot mix families and
        the replay entry compares the model's family with the traces'.
        """
        for name in ("num_layers", "moe_layer_ids", "num_experts", "top_k", "vocab_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                detail = what if name != "num_layers" else (f"{what}: " if what else "") + (
                    "num_layers counts route layers, decoder layers times the routers each holds: a model routing R "
                    "times per decoder layer (JetMoE, R = 2) takes traces of R route layers per decoder layer")
                raise GeometryMismatchError(where.with_(field=f"geometry.{name}"), mine, theirs, detail)
        if self.family and other.family and self.family != other.family:
            raise GeometryMismatchError(
                where.with_(field="geometry.family"), repr(self.family), repr(other.family),
                (f"{what}: " if what else "")
                + "the trace was recorded on another model family; replay it into a model of its own family "
                "(a geometry built by hand, e.g. Megatron's model_geometry(model, family=...), must name it)",
            )

    def with_family_of(self, other: "ModelGeometry") -> "ModelGeometry":
        """This geometry, naming `other`'s family where it names none (call after check_matches)."""
        return self if self.family or not other.family else replace(self, family=other.family)


@dataclass(frozen=True)
class EngineInfo:
    """Which engine produced a trace and in what precision."""

    name: str = "unknown"
    """Engine name, e.g. 'vllm' or 'hf'."""
    version: str = ""
    dtype: str = "float32"
    """Model compute dtype in the engine, e.g. 'bfloat16'."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form msgpack-able details (device, kernel backend, ...)."""
    noise: EngineNoise | None = None
    """The engine-noise model the engine ran under (moe_replay/noise.py), None for a clean engine:
    a perturbed trace says so (absent from the record when None, so clean records keep their bytes)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("noise")
        if self.noise is not None:
            d["noise"] = self.noise.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineInfo":
        noise = d.get("noise")
        return cls(**{**d, "noise": None if noise is None else EngineNoise.from_dict(noise)})
