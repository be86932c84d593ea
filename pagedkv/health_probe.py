"""Waits for a pagedkv service to say SERVING on grpc.health.v1 (for supervisors and containers).

    python -m pagedkv.health_probe 127.0.0.1:50052                  # exit 0 when SERVING, 1 otherwise
    python -m pagedkv.health_probe 127.0.0.1:50051 --service pagedkv.model.v1.ModelService --timeout 30
    python -m pagedkv.health_probe 127.0.0.1:50051 --now --timeout 3    # one answer, no waiting

Waiting (the default) suits a launcher or a test waiting for a service to come up: it
polls through NOT_SERVING and refused connections. `--now` suits a container health check,
which runs the probe on an interval: it asks once and fails at once on NOT_SERVING or no
answer, so the container's health follows the service's within one probe interval
instead of after --timeout seconds of hoping.

`wait_serving(address, timeout_s)` is the same from Python: it polls Health.Check until
the answer is SERVING and raises TimeoutError naming the last answer (a status, or why
the call failed) when `timeout_s` passes first. Health is plaintext and needs no token:
both services exempt it from --auth-token, so a probe works whatever the auth setting.
Imports only grpc, never torch, so a container health check costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_POLL_INTERVAL_S = 0.1
# One Check is a loopback round trip; a second is generous and keeps a hung server from
# eating the whole wait.
_CALL_DEADLINE_S = 1.0
_MIN_DEADLINE_S = 0.05


def check(channel: grpc.Channel, service: str = "", deadline_s: float = _CALL_DEADLINE_S) -> str:
    """One Health.Check; returns the status name ("SERVING", "NOT_SERVING", ...) or why the call failed."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=deadline_s)
    except grpc.RpcError as error:
        return f"{error.code().name}: {error.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(address: str, timeout_s: float, service: str = "",
                 alive: Callable[[], bool] | None = None) -> None:
    """Returns once `address` answers SERVING for `service` ("" is the whole server).

    Raises TimeoutError with the last answer seen when timeout_s passes first. Checks at
    least once, so timeout_s=0 is a single probe. `alive`, when given, is asked between
    probes: a server that exited after listening (a refused Attach) never turns SERVING,
    so ChildProcessError says so at once rather than after the whole timeout.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        while True:
            remaining = deadline - time.monotonic()
            last_seen = check(channel, service, deadline_s=max(_MIN_DEADLINE_S, min(_CALL_DEADLINE_S, remaining)))
            if last_seen == "SERVING":
                return
            if alive is not None and not alive():
                raise ChildProcessError(f"{address}: the server exited before it was SERVING; last answer: {last_seen}")
            if time.monotonic() + _POLL_INTERVAL_S > deadline:
                what = f"service {service!r}" if service else "the server"
                raise TimeoutError(f"{address}: {what} not SERVING after {timeout_s:g}s; last answer: {last_seen}")
            time.sleep(_POLL_INTERVAL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.health_probe",
        description="Exit 0 once a gRPC server answers SERVING on grpc.health.v1, 1 otherwise.",
    )
    parser.add_argument("address", help="HOST:PORT of the service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to keep polling before giving up; 0 checks once (default 3)")
    parser.add_argument("--now", action="store_true",
                        help="ask once, with --timeout as the call's deadline, and exit 1 at once unless the "
                             "answer is SERVING (for container health checks)")
    args = parser.parse_args(argv)
    if args.timeout < 0:
        parser.error(f"--timeout must be 0 or more, got {args.timeout}")
    if args.now:
        with grpc.insecure_channel(args.address) as channel:
            answer = check(channel, args.service, deadline_s=max(args.timeout, _MIN_DEADLINE_S))
        if answer != "SERVING":
            print(f"health_probe: {args.address}: {answer}", file=sys.stderr)
            return 1
        return 0
    try:
        wait_serving(args.address, args.timeout, args.service)
    except TimeoutError as error:
        print(f"health_probe: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
