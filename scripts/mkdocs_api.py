"""mkdocs hook: one API reference page per module of the package, generated at build time from the tree.

The package installs `integrations/` as `moe_replay.integrations` (pyproject's package-dir), a layout
griffe cannot see on disk; the hook copies the two into one tree, `build/docs_src/moe_replay`, that
`mkdocs.yml` points mkdocstrings at. Pages are made from what the tree holds, so a module added or
moved shows up without editing a list; `api/index.md` lists them all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOTS = {"moe_replay": "moe_replay", "moe_replay.integrations": "integrations"}
"""Import name -> folder in the repository."""
SOURCE_TREE = Path("build/docs_src")
"""Where the linked tree is made, relative to mkdocs.yml (mkdocs.yml's mkdocstrings `paths`)."""


def _repo(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _link_tree(repo: Path) -> None:
    """build/docs_src/moe_replay: the .py files of moe_replay/, with integrations/ as its `integrations`.

    Copies, not symlinks: griffe resolves a symlinked file to its real folder and would walk that instead.
    """
    top = repo / SOURCE_TREE / "moe_replay"
    if top.parent.exists():
        shutil.rmtree(top.parent)
    for name, folder in ROOTS.items():
        dest = top.joinpath(*name.split(".")[1:])
        for path in (repo / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                target = dest / path.relative_to(repo / folder)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)


def modules(repo: Path) -> list[str]:
    """Every module and package of the installed package, by import name, sorted."""
    names = []
    for name, folder in ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "__pycache__" not in rel.parts:
                names.append(".".join([name, *parts]))
    return sorted(set(names))


@event_priority(100)  # before mkdocstrings' on_config, which drops a `paths` entry not yet on disk
def on_config(config):
    _link_tree(_repo(config))
    return config


def on_files(files, config):
    names = modules(_repo(config))
    for name in names:
        files.append(File.generated(config, f"api/{name}.md", content=f"# `{name}`\n\n::: {name}\n"))
    index = ["# API reference", "", "Generated from the docstrings, one page per module.", ""]
    index += [f"- [`{name}`]({name}.md)" for name in names]
    files.append(File.generated(config, "api/index.md", content="\n".join(index) + "\n"))
    return files
