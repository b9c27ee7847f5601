"""Presets: one YAML file switches capture, replay, π_old estimation and corrections on or off.

Each section is validated by the configuration class of the part it drives, so there is one
definition of every field: `capture` -> CaptureConfig (capture_config.py), `replay` -> PlanConfig plus
the two replay switches, `estimator` -> EstimatorConfig plus the scorer switches, `corrections`
-> the correction registry. An unknown key or an invalid value is a ValueError that names the
preset, the section and the key, and lists what is allowed.

    preset = load_preset("r3_support")        # a shipped preset (configs/*.yaml), or a path
    preset.replay.routes, preset.capture.support, preset.estimator.enabled
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from .capture_config import CaptureConfig
from .corrections import CorrectionConfig, build_correction
from .errors import ConfigFileError, ConfigFileNotFoundError, Where
from .estimator import EstimatorConfig
from .replay import PlanConfig

SECTIONS = ("name", "description", "capture", "replay", "estimator", "corrections", "audit")


@dataclass(frozen=True)
class ReplaySettings:
    """What the trainer replays from the traces."""

    routes: bool = False
    """Force the engine's experts (R3)."""
    support: bool = False
    """Score over the engine's kept sampling support."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Batch layout and unrouted-prefix policy."""
    trainer_path: str = "auto"
    """Which of the trainer binding's replay paths forces the routes: "auto" (the binding's rule) or
    one it offers (Megatron: "project" or "megatron_native", integrations/megatron/paths.py; HF:
    "project"). Checked against the trainer at enable()."""

    def __post_init__(self) -> None:
        if not isinstance(self.trainer_path, str) or not self.trainer_path.isidentifier():
            raise ValueError(f"trainer_path: expected a path name such as 'auto', 'project' or 'megatron_native', "
                             f"found {self.trainer_path!r}")


@dataclass(frozen=True)
class EstimatorSettings:
    """Multi-sample π_old on the inference engine."""

    enabled: bool = False
    force_routes: bool = True
    """Re-score under the trace's routes, so only engine noise is averaged."""
    use_support: bool = True
    """Renormalise re-scored tokens over the trace's support."""
    config: EstimatorConfig = field(default_factory=EstimatorConfig)


@dataclass(frozen=True)
class AuditSettings:
    """When a trainer preset (TRL's `MoeReplayGRPOTrainer`, verl's FSDP engine) audits a batch's routes
    against the model's own routing before training on it (`moe_replay.audit`: one forward without
    gradients), stopping with the audit's verdict (RouteAlignmentError) where they do not line up."""

    first_batch: bool = False
    """Audit the first batch."""
    every: int = 0
    """Audit every N-th batch (batches 0, N, 2N, ...); 0 = only the first, if `first_batch`."""

    def __post_init__(self) -> None:
        if not isinstance(self.first_batch, bool):
            raise ValueError(f"audit.first_batch: expected true/false, found {self.first_batch!r}")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"audit.every: expected an int >= 0 (0 = never after the first batch), found {self.every!r}")

    @property
    def enabled(self) -> bool:
        return self.first_batch or self.every > 0

    def due(self, batch: int) -> bool:
        """Whether batch number `batch` (0 = the first) is audited."""
        return (self.first_batch and batch == 0) or (self.every > 0 and batch % self.every == 0)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    capture: CaptureConfig
    replay: ReplaySettings = field(default_factory=ReplaySettings)
    estimator: EstimatorSettings = field(default_factory=EstimatorSettings)
    corrections: tuple[CorrectionConfig, ...] = ()
    audit: AuditSettings = field(default_factory=AuditSettings)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for logs and report.json."""
        out = dataclasses.asdict(self)
        out["corrections"] = [{"name": c.name, **dataclasses.asdict(c)} for c in self.corrections]
        return out


def _split(where: str, section: Mapping[str, Any], own: set[str], target: type,
           names: frozenset[str] = frozenset()) -> tuple[dict, dict]:
    """Keys of this section's own switches (true/false; `names`: strings), and the rest for `target`;
    unknown keys are errors."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}: expected a mapping, found {type(section).__name__}")
    allowed = own | names | {f.name for f in dataclasses.fields(target)}
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    mine = {k: v for k, v in section.items() if k in own | names}
    for k, v in mine.items():
        if k in own and not isinstance(v, bool):
            raise ValueError(f"{where}.{k}: expected true/false, found {v!r}")
    return mine, {k: v for k, v in section.items() if k not in own | names}


def _build(where: str, cls: type, kwargs: dict) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def preset_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Preset:
    """Validate a preset's plain data (as loaded from YAML)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"preset {source}: expected a mapping at the top level, found {type(data).__name__}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(f"preset {source}: unknown section(s) {unknown}; allowed: {list(SECTIONS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"preset {source}: 'name' must be a non-empty string, found {name!r}")
    where = f"preset {name!r} ({source})"
    capture_d = data.get("capture", {})
    _split(f"{where} capture", capture_d, set(), CaptureConfig)
    capture = _build(f"{where} capture", CaptureConfig, dict(capture_d))

    switches, plan_kw = _split(f"{where} replay", data.get("replay", {}), {"routes", "support"}, PlanConfig,
                               frozenset({"trainer_path"}))
    replay = _build(f"{where} replay", ReplaySettings, {**switches, "plan": _build(f"{where} replay", PlanConfig, plan_kw)})
    if (replay.routes and not capture.routes) or (replay.support and not capture.support):
        raise ValueError(f"{where}: replay needs what it replays captured; set capture.routes/capture.support to true")

    switches, est_kw = _split(f"{where} estimator", data.get("estimator", {}), {"enabled", "force_routes", "use_support"}, EstimatorConfig)
    estimator = EstimatorSettings(**switches, config=_build(f"{where} estimator", EstimatorConfig, est_kw))

    corr = data.get("corrections", []) or []
    if not isinstance(corr, list):
        raise ValueError(f"{where} corrections: expected a list, found {type(corr).__name__}")
    corrections = []
    for i, spec in enumerate(corr):
        try:
            corrections.append(build_correction(spec))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} corrections[{i}]: {e}") from None
    audit_d = data.get("audit", {}) or {}
    _split(f"{where} audit", audit_d, set(), AuditSettings)
    audit = _build(f"{where} audit", AuditSettings, dict(audit_d))
    if audit.enabled and not capture.routes:
        raise ValueError(f"{where}: audit checks the captured routes; set capture.routes to true (or drop audit)")
    return Preset(name, str(data.get("description", "")), capture, replay, estimator, tuple(corrections), audit)


def preset_names() -> list[str]:
    """Presets shipped with the package (configs/*.yaml)."""
    return sorted(p.name[: -len(".yaml")] for p in resources.files("moe_replay.configs").iterdir() if p.name.endswith(".yaml"))


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    """A shipped preset by name, or a YAML file by path (ConfigFileError naming the file when it
    is not a readable UTF-8 YAML file)."""
    import yaml

    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, source = _read_preset_file(path), str(path)
    else:
        res = resources.files("moe_replay.configs") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise ValueError(f"unknown preset {str(name_or_path)!r}; shipped presets: {preset_names()} (or pass a YAML path)")
        text, source = res.read_text(), f"configs/{name_or_path}.yaml"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:  # its message spans lines (the mark, a caret): one line here
        raise ConfigFileError(Where(file=source), "a YAML preset", f"invalid YAML: {' '.join(str(e).split())}") from None
    return preset_from_dict(data, source)


def _read_preset_file(path: Path) -> str:
    where, want = Where(file=str(path)), "a preset YAML file"
    if not path.exists():
        raise ConfigFileNotFoundError(where, want, "no such file", f"shipped presets: {preset_names()}")
    if not path.is_file():
        raise ConfigFileError(where, want, "a directory" if path.is_dir() else "not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigFileError(where, want, f"a file that cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(where, "UTF-8 text (YAML)", f"byte {data[e.start]:#04x} at offset {e.start}, not UTF-8") from None
