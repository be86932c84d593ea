"""C kernels for the CPU hot path: paged decode attention and a decoder layer's fused
elementwise ops, built at first use (build.py) and called through ctypes."""

from model_service.cpu_kernels.build import load, load_error

__all__ = ["load", "load_error"]
