"""The stub backend's driver: active (vLLM's check counts it only when no GPU driver is), CPU target."""

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the MRV2 test bed's Triton backend compiles nothing (TRITON_INTERPRET=1)")

    def get_current_target(self):
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the MRV2 test bed's Triton backend benchmarks nothing")
