"""Shared test fixtures: tiny local MoE models (built once per session) and in-process vLLM.

Fixtures
--------
tiny_model(family="qwen3_moe", *, size="tiny", seed=0, **config_overrides) -> Path
    Session-scoped factory. Builds the checkpoint + tokenizer with
    `moe_replay.models.build_tiny_model` into a session tmp dir the first time a given
    (family, size, seed, overrides) is asked for, and returns the cached path afterwards.
    Treat the directory as read-only: other tests share it.

vllm_llm(model_dir, **llm_overrides) -> vllm.LLM
    Function-scoped factory for an in-process vLLM-CPU engine with the project's test
    settings (VLLM_TEST_ARGS: fp32, eager, max_model_len 512, seed 0, "uni" executor). Every
    engine it made is shut down at teardown, so families can follow one another in a process.
    Skips the test when vLLM is not installed.

Model runners
-------------
A session runs vLLM's V1 runner unless MOE_REPLAY_TEST_RUNNER=mrv2, which activates the Model
Runner V2 test bed (tests/runners.py, tests/mrv2_bed/) before anything imports vLLM and keeps only
the tests marked `mrv2` (`make test` runs both sessions). `runner` (a fixture) is "v1" or "mrv2".
"""

from __future__ import annotations

import os

# Must be set before vllm is imported anywhere in the session (conftest loads first).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at run time, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from .runners import RUNNER, activate_mrv2  # noqa: E402
from . import workers  # noqa: E402

workers.worker_env()  # an xdist worker's threads (tests/workers.py), before torch is imported

if RUNNER == "mrv2":
    activate_mrv2()

import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from . import timing  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """The time report (tests/timing.py) at the end of every session."""
    if not config.pluginmanager.has_plugin("moe_replay_timing"):
        config.pluginmanager.register(timing, "moe_replay_timing")

VLLM_TEST_ARGS: dict[str, Any] = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=512,
    seed=0,
    distributed_executor_backend="uni",
)
"""LLM(...) keyword arguments for tests on the tiny models (see shared notes: vllm-cpu.md)."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from moe_replay.models import build_tiny_model

    cache: dict[str, Path] = {}

    def get(family: str = "qwen3_moe", *, size: str = "tiny", seed: int = 0, **config_overrides: Any) -> Path:
        key = json.dumps([family, size, seed, config_overrides], sort_keys=True, default=repr)
        if key not in cache:
            tag = f"{family}-{size}-s{seed}" + ("-custom" if config_overrides else "")
            cache[key] = build_tiny_model(
                family, tmp_path_factory.mktemp(tag), seed=seed, size=size, **config_overrides
            )
        return cache[key]

    return get


def shutdown_llm(llm: Any) -> None:
    """Stop an in-process engine so the next one can start (see shared notes: vllm-cpu.md)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture
def vllm_llm() -> Iterator[Callable[..., Any]]:
    vllm = pytest.importorskip("vllm")
    engines: list[Any] = []

    def make(model_dir: str | os.PathLike, **llm_overrides: Any) -> Any:
        args = {**VLLM_TEST_ARGS, **llm_overrides}
        if args["dtype"] == "float32" and "kv_lora_rank" in json.loads((Path(model_dir) / "config.json").read_text()):
            # MLA (DeepSeek) on an AMX CPU: vLLM-CPU picks its AMX MLA backend, which takes bf16/fp16
            # weights only ("expect weight to be bfloat16, float16, ..."); its reference CPU MLA runs fp32.
            args.setdefault("attention_config", {"backend": "CPU_MLA"})
        llm = vllm.LLM(model=str(model_dir), **args)
        engines.append(llm)
        return llm

    yield make
    while engines:
        shutdown_llm(engines.pop())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under MOE_REPLAY_TEST_RUNNER=mrv2 only the tests marked `mrv2` run (the rest were run by the V1 session);
    on xdist workers, modules longest first (tests/workers.py)."""
    if RUNNER == "mrv2":
        keep = [item for item in items if item.get_closest_marker("mrv2") is not None]
        dropped = [item for item in items if item.get_closest_marker("mrv2") is None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    if workers.WORKER is not None:
        workers.order_longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadscope`: a module (or a shared scope) per work unit, longest first (tests/workers.py)."""
    if config.getvalue("dist") == "loadscope":
        return workers.make_scheduler(config, log)
    return None


@pytest.fixture(scope="session")
def runner() -> str:
    """The vLLM model runner this session's engines run: "v1" or "mrv2" (tests/runners.py)."""
    return RUNNER


@pytest.fixture(scope="session")
def sglang_server(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SGLang server of the CPU test bed (tests/sglang_bed/bed.py: its own venv, launch_server as a
    subprocess) on the tiny qwen3_moe, for the session; `.url`, `.model_dir`. Skips where the bed is not
    built (`make test` builds it: scripts/sglang_bed.py)."""
    from tests.sglang_bed import bed

    if not bed.available():
        pytest.skip(f"the SGLang test bed is not built ({bed.PYTHON}): python3 scripts/sglang_bed.py")
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(bed.server(tiny_model("qwen3_moe"), tmp_path_factory.mktemp("sglang") / "server.log"))
        timing.note_engine("sglang", time.perf_counter() - t0)
        _server_stops.append(stack.close)
        yield server


_server_stops: list[Callable[[], None]] = []
_last_server_user: dict[str, str] = {}
"""The nodeid of the last collected test that uses `sglang_server`: the server stops after its teardown.
Why not at the session's end: SGLang's idle scheduler polls, one core at ~60% (measured under `make test`),
for every test that runs after the SGLang modules."""


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if "sglang_server" in getattr(item, "fixturenames", ())]
    if users:
        _last_server_user["nodeid"] = users[-1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    if item.nodeid == _last_server_user.get("nodeid"):
        while _server_stops:
            _server_stops.pop()()
