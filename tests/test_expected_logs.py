"""Expected framework warnings are dropped at their loggers, only inside the project's own weight
syncs and demo runs; every other record passes, and MOE_REPLAY_VERBOSE=1 shows all."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from moe_replay.expected_logs import VERBOSE_ENV, ExpectedLog, expected_logs

ROOT = Path(__file__).resolve().parent.parent
LOADER_LOGGER = "vllm.model_executor.models.utils"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class Seen(logging.Handler):
    """Collects the messages that reach the handlers of the loggers it is put on."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def watching(*names: str) -> Iterator[Seen]:
    """A handler on vLLM's loader and reload loggers and on `names` (the same texts logged there
    must pass); filters sit before a logger's handlers, so it sees what users would. Put on after
    vLLM is imported and its engine built: vLLM's logging set-up (dictConfig) empties the handlers
    of every logger under 'vllm' (their filters stay)."""
    handler = Seen()
    loggers = [logging.getLogger(n) for n in (LOADER_LOGGER, RELOAD_LOGGER, *names)]
    # Earlier tests in the same process may have run a logging dictConfig that disables existing
    # loggers (hydra's, under verl) or raised vLLM's level: what is under test is the filters, so
    # the loggers are enabled at vLLM's default level (INFO) for the block and restored after.
    saved = [(lg, lg.disabled, lg.level) for lg in loggers]
    for lg in loggers:
        lg.disabled = False
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg, disabled, level in saved:
            lg.removeHandler(handler)
            lg.disabled, lg.level = disabled, level


@pytest.fixture
def seen():
    pytest.importorskip("vllm")
    import vllm.model_executor.model_loader.reload.layerwise  # noqa: F401  (vLLM's logging set up first)
    import vllm.model_executor.models.utils  # noqa: F401

    with watching("vllm.model_executor.model_loader.utils") as handler:
        yield handler


def _load_into(dtype, weight_dtype):
    """vLLM's own loader (AutoWeightsLoader) loading a `weight_dtype` tensor into a `dtype` parameter:
    it logs the dtype message from vLLM's code, not from a copy of its text."""
    import torch
    from vllm.model_executor.models.utils import AutoWeightsLoader

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(2, 2, dtype=dtype), requires_grad=False)

    AutoWeightsLoader(M()).load_weights([("w", torch.zeros(2, 2, dtype=weight_dtype))])


def _emit_all() -> None:
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    _load_into(torch.bfloat16, torch.float32)  # expected: an fp32 trainer into a bf16 engine
    _load_into(torch.float16, torch.float32)  # expected
    _load_into(torch.float8_e4m3fn, torch.float32)  # not expected: a quantised parameter
    layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")  # vLLM's call, its logger
    layerwise.logger.warning("%s: Failed to load weights", "FusedMoE")  # a layer that holds weights: passes
    logging.getLogger("vllm.model_executor.model_loader.utils").warning("RotaryEmbedding: Failed to load weights")


EXPECTED_FOUND = 2 + 1  # two dtype casts, one rotary layer
OTHERS = [
    "Attempted to load weight w with dtype torch.float32 into parameter with dtype torch.float8_e4m3fn",
    "FusedMoE: Failed to load weights",
    "RotaryEmbedding: Failed to load weights",  # on another logger
]


def test_sync_rules_drop_exactly_vllms_expected_messages(seen, monkeypatch):
    from moe_replay.integrations.vllm.weights import EXPECTED_SYNC_LOGS

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    with expected_logs(EXPECTED_SYNC_LOGS) as dropped:
        _emit_all()
    assert seen.messages == OTHERS
    assert dropped.count == EXPECTED_FOUND

    seen.messages.clear()  # outside the block everything passes: the filters came off
    _emit_all()
    assert len(seen.messages) == len(OTHERS) + EXPECTED_FOUND
    assert not any(f for lg in (LOADER_LOGGER, RELOAD_LOGGER) for f in logging.getLogger(lg).filters)

    seen.messages.clear()
    monkeypatch.setenv(VERBOSE_ENV, "1")
    with expected_logs(EXPECTED_SYNC_LOGS) as dropped:
        _emit_all()
    assert len(seen.messages) == len(OTHERS) + EXPECTED_FOUND and dropped.count == 0


def test_nested_blocks_take_off_only_their_own_filters(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    rule = ExpectedLog("moe_replay.test.nested", r"x\d", "test")
    log = logging.getLogger(rule.logger)
    with watching(rule.logger) as seen, expected_logs([rule]) as outer:
        with expected_logs([rule]) as inner:
            log.warning("x1")
        log.warning("x2")  # the outer filter is still on
        log.warning("y")
    with watching(rule.logger) as after:
        log.warning("x3")
    assert after.messages == ["x3"]
    assert seen.messages == ["y"] and outer.count + inner.count == 2  # the first filter on drops x1


def test_a_rule_needs_a_logger_and_a_valid_pattern():
    with pytest.raises(ValueError, match="logger name"):
        ExpectedLog("", "x", "why")
    with pytest.raises(Exception, match="unterminated|missing"):
        ExpectedLog("a", "(", "why")


@pytest.mark.vllm
def test_update_weights_is_quiet_unless_verbose(tiny_model, vllm_llm, monkeypatch):
    """On a real bf16 engine, a sync of the fp32 checkpoint logs vLLM's casts, its rotary warning
    and its INFO lines (two, plus a once-per-process filesystem line) only under MOE_REPLAY_VERBOSE=1; a record on those loggers that no rule
    names passes either way."""
    from moe_replay.integrations.vllm.weights import EXPECTED_SYNC_LOGS, update_weights

    model_dir = tiny_model("qwen3_moe")
    llm = vllm_llm(model_dir, dtype="bfloat16")
    names = [r.logger for r in EXPECTED_SYNC_LOGS]
    runs = {}
    for verbose in ("", "1"):
        monkeypatch.setenv(VERBOSE_ENV, verbose)
        with watching(*names) as seen:
            update_weights(llm, model_dir)
            logging.getLogger(LOADER_LOGGER).warning("not a sync's line")
        runs[verbose] = seen.messages
    quiet, loud = runs[""], runs["1"]
    casts = [m for m in loud if m.startswith("Attempted to load weight") and m.endswith("torch.bfloat16")]
    info = [m for m in loud if m.startswith(("Reloading and processing", "Successfully reset"))]
    # vLLM logs "Filesystem type ..." with info_once keyed on its arguments, available RAM among them:
    # under a cgroup limit that figure repeats, and the quiet run's call already spent the line.
    fs_lines = [m for m in loud if m.startswith("Filesystem type")]
    assert len(casts) == 15 and loud.count("RotaryEmbedding: Failed to load weights") == 1 and len(info) == 2, loud
    assert len(fs_lines) <= 1, fs_lines
    assert quiet == ["not a sync's line"] and loud[-1] == "not a sync's line"


@pytest.mark.vllm
@pytest.mark.slow
def test_make_demo_prints_at_most_150_lines(tmp_path):
    """`make demo`'s command in a fresh interpreter, at the default size: its whole console (stdout
    and stderr) fits 150 lines, with none of the expected warnings (780 of 1,292 lines unfiltered)."""
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_ENV}
    proc = subprocess.run([sys.executable, "-m", "moe_replay.cli", "demo", "--out", str(tmp_path / "demo")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert not [ln for ln in lines if "Attempted to load weight" in ln or "Failed to load weights" in ln]
    assert len(lines) <= 150, "\n".join(lines)
