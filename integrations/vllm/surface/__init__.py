"""The vLLM release surface: every vLLM name the adapter relies on (needs.py), checked against a
release's source without importing it (source.py, check.py); the table of every release
(table.json) is what `versions.py` accepts or refuses by. `scripts/vllm_surface.py` writes it."""

from __future__ import annotations

from .check import ACCEPTED_RULE, TABLE, check_installed, check_tree, load_table, write_table
from .needs import RUNNERS, SURFACE, Need, surface_hash
from .source import DirTree, WheelTree

__all__ = ["ACCEPTED_RULE", "DirTree", "Need", "RUNNERS", "SURFACE", "TABLE", "WheelTree", "check_installed",
           "check_tree", "load_table", "surface_hash", "write_table"]
