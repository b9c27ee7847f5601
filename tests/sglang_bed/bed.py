"""The SGLang CPU test bed, from the project's venv: its interpreter, its environment, a server, a driver.

Test infrastructure, never a user install (docs/sglang.md). SGLang runs in its own venv (.venv/sglang,
scripts/sglang_bed.py: transformers 5.19 there, 5.24 here) as subprocesses: a server
(`python -m sglang.launch_server`) the tests talk to over HTTP, or a driver script that builds an
`sglang.Engine` in that venv. Every such process gets PYTHONPATH=tests/sglang_bed, so Python loads the
bed's sitecustomize.py (stand-ins and fixes) in it and in the scheduler and detokenizer it spawns.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

BED = Path(__file__).resolve().parent
ROOT = BED.parent.parent
VENV = Path(os.environ.get("MOE_REPLAY_SGLANG_VENV", ROOT / ".venv" / "sglang"))
PYTHON = VENV / "bin" / "python"

ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
    enable_return_routed_experts=True, mem_fraction_static=0.05, max_total_tokens=4096, max_running_requests=16,
    chunked_prefill_size=512, dtype="float32", skip_server_warmup=True, random_seed=0,
)
"""sglang.Engine(...) / launch_server flags of the bed (../shared/notes/sglang-cpu.md): CPU, torch-native
attention and sampling, no CUDA graphs, routes returned, a small KV pool, fp32, seed 0."""


def available() -> bool:
    """Whether the bed's venv is built (scripts/sglang_bed.py; `make test` builds it)."""
    return PYTHON.exists()


def env(threads: int = 1) -> dict[str, str]:
    """The environment of every bed process: the sitecustomize on PYTHONPATH, the CPU engine, no hub."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(BED), str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: str | os.PathLike, port: int, **overrides: Any) -> list[str]:
    """`python -m sglang.launch_server` with ENGINE_ARGS as flags (True -> a bare flag)."""
    cmd = [str(PYTHON), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    for k, v in {**ENGINE_ARGS, **overrides}.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            cmd.append(flag)
        elif v is not False:
            cmd += [flag, str(v)]
    return cmd


class Server:
    """One launch_server process (its own process group), its URL and its log."""

    def __init__(self, model_dir: str | os.PathLike, log_path: str | os.PathLike, **overrides: Any) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(server_command(model_dir, self.port, **overrides), env=env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> "Server":
        """Until /model_info answers (SGLang's ready point with skip_server_warmup); RuntimeError with the log's tail."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as r:
                    json.loads(r.read())
                return self
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the SGLang server was not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the server's process group (it and the scheduler / detokenizer it spawned), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def server(model_dir: str | os.PathLike, log_path: str | os.PathLike, **overrides: Any) -> Iterator[Server]:
    s = Server(model_dir, log_path, **overrides)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def run_driver(script: str | os.PathLike, *args: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    """Run a script with the bed's interpreter and environment (an sglang.Engine lives only there); the
    completed process (its stdout / stderr captured). A driver guards its work with `__main__`: SGLang
    spawns its scheduler, which imports the script again."""
    return subprocess.run([str(PYTHON), str(script), *map(str, args)], env=env(), capture_output=True, text=True,
                          timeout=timeout_s, start_new_session=True)


def engine_args(**overrides: Any) -> dict[str, Any]:
    """ENGINE_ARGS with overrides, for a driver's sglang.Engine(model_path=..., **engine_args())."""
    return {**ENGINE_ARGS, "log_level": "error", **overrides}


if __name__ == "__main__":  # python tests/sglang_bed/bed.py MODEL_DIR: a server until Ctrl-C (by hand)
    with server(sys.argv[1], "/tmp/sglang-bed-server.log") as s:
        print(s.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            s.proc.wait()
