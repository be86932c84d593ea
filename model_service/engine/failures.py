"""The status a request gets when the engine step it was in raised."""

from __future__ import annotations

import grpc
import torch


def step_failure_status(error: Exception) -> tuple[grpc.StatusCode, str]:
    """RESOURCE_EXHAUSTED for an allocation the step caused, INTERNAL otherwise; the message
    says that only the requests of that step ended."""
    out_of_memory = isinstance(error, torch.OutOfMemoryError)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if out_of_memory else grpc.StatusCode.INTERNAL
    return code, (f"the engine step running this request failed ({type(error).__name__}"
                  f"{': out of device memory' if out_of_memory else ''}); the requests of that step "
                  "were ended, others run on; see the service log")
