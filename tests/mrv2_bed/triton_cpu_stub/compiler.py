"""The stub backend's compiler: refuses every compile (the interpreter runs the kernels)."""

from triton.backends.compiler import BaseBackend

_WHY = ("the moe_replay MRV2 test bed's 'cpu' Triton backend compiles nothing: run with TRITON_INTERPRET=1 "
        "(tests/mrv2_bed/README.md)")


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target):
        return getattr(target, "backend", None) == "cpu"

    def hash(self) -> str:
        return "moe-replay-interpreter-only"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(_WHY)

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise RuntimeError(_WHY)

    def load_dialects(self, context) -> None:
        raise RuntimeError(_WHY)

    def get_module_map(self) -> dict:
        return {}
