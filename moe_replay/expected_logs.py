"""Log messages of the frameworks moe_replay drives that are expected where moe_replay causes them,
dropped at their source; every other record passes.

vLLM warns, for instance, on every tensor an fp32 trainer's checkpoint casts into a bf16 engine,
and on every weight sync: 780 of the 1,292 lines `moe-replay demo` printed were that one message.
An adapter names each such message once as an `ExpectedLog` (the logger that emits it and a
pattern on the formatted text) and runs the code that causes it inside `expected_logs(rules)`,
which puts a `logging.Filter` on exactly those loggers and takes it off on exit.

    with expected_logs(EXPECTED_SYNC_LOGS) as dropped:
        runner.reload_weights(...)
    dropped.count   # records the rules removed

MOE_REPLAY_VERBOSE=1 (the CLI's `--verbose`) turns the filtering off: in this process, and in
engine processes started after it is set, which inherit the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

VERBOSE_ENV = "MOE_REPLAY_VERBOSE"
"""Set to 1 to show every log record, expected ones included."""


@dataclass(frozen=True)
class ExpectedLog:
    """One message a framework logs where moe_replay expects it."""

    logger: str
    """Name of the logger that emits the record (the filter sits on this logger only, so the same
    text from any other logger passes)."""
    pattern: str
    """Regular expression the whole formatted message must match (`re.fullmatch`)."""
    why: str
    """Why the message is expected there, not a fault (documentation; never printed)."""

    def __post_init__(self) -> None:
        if not self.logger:
            raise ValueError(f"ExpectedLog needs a logger name, got {self.logger!r}")
        re.compile(self.pattern)  # a bad pattern fails where the rule is written


def verbose() -> bool:
    """Whether expected messages are shown (MOE_REPLAY_VERBOSE set to anything but '', '0')."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _Drop(logging.Filter):
    """Drops records matching any pattern; compared by identity, so `removeFilter` takes off this
    instance even when a nested block put an equal one on the same logger."""

    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns, self.count = patterns, 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's to report, not ours to hide
            return True
        if any(p.fullmatch(message) for p in self.patterns):
            self.count += 1
            return False
        return True


@dataclass
class Dropped:
    """What one `expected_logs` block removed."""

    count: int = 0


@contextlib.contextmanager
def expected_logs(rules: Sequence[ExpectedLog]) -> Iterator[Dropped]:
    """Drop the records `rules` describe, on their loggers, inside the block; on exit the filters
    come off and `Dropped.count` says how many records they removed. A no-op under
    MOE_REPLAY_VERBOSE=1. Blocks nest: each puts on and takes off its own filters."""
    dropped = Dropped()
    if verbose() or not rules:
        yield dropped
        return
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for rule in rules:
        by_logger.setdefault(rule.logger, []).append(re.compile(rule.pattern))
    filters = [(logging.getLogger(name), _Drop(patterns)) for name, patterns in by_logger.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield dropped
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
            dropped.count += f.count
