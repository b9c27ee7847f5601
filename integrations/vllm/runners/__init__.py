"""One port per vLLM model runner (base.RunnerPort): V1 (v1.py) and Model Runner V2 (mrv2.py)."""

from __future__ import annotations

from typing import Any

from .base import RunnerPort


MRV2_MARK = "req_states"
"""The attribute only Model Runner V2 has (its request state; V1 keeps `requests` and `input_batch`):
a runner is told by what it holds, the way the port then reads it (its config's
`use_v2_model_runner` says the same where there is a config: model.runner_path)."""


def port_of(runner: Any) -> RunnerPort:
    """The runner's port, made once and kept in its RunnerState (runner.py)."""
    from ..runner import runner_state

    st = runner_state(runner)
    if st.port is None:
        if hasattr(runner, MRV2_MARK):
            from .mrv2 import Mrv2Port

            st.port = Mrv2Port(runner)
        else:
            from .v1 import V1Port

            st.port = V1Port(runner)
    return st.port


__all__ = ["RunnerPort", "port_of"]
