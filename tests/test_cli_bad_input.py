"""Every `moe-replay` subcommand, fed bad files: one line naming the path, expected vs found, a
non-zero exit, no traceback. Inputs are checked before anything slow starts (no vLLM engine here:
a row that got past its checks would start one and time out)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_replay.cli import COMMANDS, main
from moe_replay.errors import ConfigFileError, ConfigFileNotFoundError
from moe_replay.presets import load_preset

REPO = Path(__file__).resolve().parents[1]

# A bad input of each kind, made under tmp_path; "{bad}" in a row's argv is its path.
KINDS = {
    "random_bytes": lambda d: _write(d / "bad.bin", os.urandom(4096)),
    "random_yaml": lambda d: _write(d / "bad.yaml", b"\xff\xfe" + os.urandom(4094)),
    "empty": lambda d: _write(d / "empty.json", b""),
    "empty_yaml": lambda d: _write(d / "empty.yaml", b""),
    "directory": lambda d: _mkdir(d / "a_dir"),
    "missing": lambda d: d / "no" / "such" / "path",
    "missing_yaml": lambda d: d / "no_such_preset.yaml",
    "file_in_path": lambda d: _write(d / "plain_file", b"x") / "below",
    "foreign_dir": lambda d: _write(_mkdir(d / "foreign") / "notes.txt", b"hello").parent,
    "random_index": lambda d: _write(_mkdir(d / "fake_store") / "index.bin", os.urandom(100)).parent,
    "outputs_blocked": lambda d: _mkdir(_mkdir(d / "out") / "report.html").parent,
}

# (subcommand, argv with "{bad}", kinds of bad input for that argument)
TABLE = [
    ("make-model", ["--family", "qwen3_moe", "--out", "{bad}"], ["random_bytes", "empty", "file_in_path"]),
    ("demo", ["--out", "{bad}"], ["random_bytes", "empty", "file_in_path", "outputs_blocked"]),
    ("demo", ["--out", "{tmp}/demo", "--arms", "a={bad}"],
     ["random_yaml", "empty_yaml", "directory", "missing_yaml"]),
    ("inspect", ["{bad}"], ["random_bytes", "empty", "missing", "foreign_dir", "random_index", "file_in_path"]),
    ("report", ["{bad}"], ["random_bytes", "empty", "directory", "missing"]),
    ("report", ["{tmp}/report.json", "--out", "{bad}"], ["random_bytes", "file_in_path", "outputs_blocked"]),
    ("lab", ["--out", "{bad}"], ["random_bytes", "empty", "file_in_path", "outputs_blocked"]),
    ("bench", ["--benchmarks-dir", "{bad}"], ["random_bytes", "empty", "missing"]),
    ("bench", ["--benchmarks-dir", "{tmp}/benchmarks", "--out", "{bad}"], ["directory", "file_in_path"]),
    ("rescue", ["{bad}", "{tmp}/copy"], ["random_bytes", "empty", "missing", "foreign_dir", "random_index"]),
    ("rescue", ["{tmp}/store", "{bad}"], ["random_bytes", "foreign_dir", "file_in_path"]),
    ("audit", ["{tmp}/no_model", "{bad}"], ["random_bytes", "empty", "missing", "directory", "foreign_dir", "random_index",
                                           "file_in_path"]),
    ("audit", ["{bad}", "{tmp}/routes.jsonl"], ["random_bytes", "missing", "foreign_dir", "file_in_path"]),
]
CASES = [pytest.param(cmd, argv, kind, id=f"{cmd}-{'-'.join(a for a in argv if a.startswith('--'))}-{kind}")
         for cmd, argv, kinds in TABLE for kind in kinds]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _good_inputs(tmp: Path) -> None:
    """The arguments of a row that are not under test: a valid report, store and benchmarks folder."""
    from moe_replay.store import DirectoryStore
    from tests.test_report import synthetic_report

    (tmp / "report.json").write_text(json.dumps(synthetic_report()))
    with DirectoryStore(tmp / "store", durable=False):
        pass
    _write(_mkdir(tmp / "benchmarks") / "noop.py", b"print('{}')\n")
    _write(tmp / "routes.jsonl", b'{"token_ids": [5, 6, 7], "routed_experts": [[[0, 1]], [[2, 3]]]}\n')


def test_the_table_covers_every_subcommand():
    assert {cmd for cmd, _, _ in TABLE} == set(COMMANDS.names())


@pytest.mark.parametrize("cmd,argv,kind", CASES)
def test_bad_input_is_one_line_naming_the_path(tmp_path, capsys, cmd, argv, kind):
    bad = KINDS[kind](tmp_path)
    _good_inputs(tmp_path)
    before = {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    args = [cmd] + [a.replace("{bad}", str(bad)).replace("{tmp}", str(tmp_path)) for a in argv]
    code = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1, err
    line = lines[0]
    assert line.startswith(f"moe-replay {cmd}: error: "), line
    assert "expected" in line and "found" in line, line
    named = {str(bad), str(bad.parent)} | ({str(bad / "report.html")} if kind == "outputs_blocked" else set())
    assert any(n in line for n in named), line
    assert "readonly=" not in line and "--store" not in line and "Traceback" not in err
    assert {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p in before} == before  # nothing written over


def test_the_command_line_prints_no_traceback(tmp_path):
    """The installed entry point end to end (a fresh interpreter), on a file of random bytes."""
    bad = _write(tmp_path / "report.json", os.urandom(4096))
    proc = subprocess.run([sys.executable, "-m", "moe_replay.cli", "report", str(bad)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"moe-replay report: error: {str(bad)!r}: expected UTF-8 JSON text, found byte 0x")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("content,found", [(b"\xff\xfe\x00garbage", "not UTF-8"), (b"a: [1,\n b: }", "invalid YAML"),
                                           (None, "a directory")])
def test_a_bad_preset_file_is_a_typed_error_naming_it(tmp_path, content, found):
    """Through load_preset and moe_replay.enable alike: ConfigFileError (a ValueError) naming the file."""
    import moe_replay

    path = tmp_path / "p.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    for call in (lambda: load_preset(path), lambda: moe_replay.enable(str(path), model=object())):
        with pytest.raises(ConfigFileError, match=found) as e:
            call()
        assert e.value.where.file == str(path) and "\n" not in str(e.value)
    with pytest.raises(ConfigFileNotFoundError, match="no such file"):
        load_preset(tmp_path / "absent.yaml")
