"""Command-line flags with PAGEDKV_* environment twins.

Every flag `--some-flag` can also be set by `PAGEDKV_SOME_FLAG`; the command line wins.
The twin is shown in --help so nobody has to guess it. A flag that can be repeated
(`repeat=True`) takes its twin as values separated by whitespace, and the command line's
values replace the twin's rather than add to them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "PAGEDKV_" + flag.lstrip("-").replace("-", "_").upper()


class _Repeated(argparse.Action):
    """argparse's append, except that the first value on the command line replaces the
    default (the twin's values) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        if current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, values])


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default: Any = None, help: str, repeat: bool = False,
             **kwargs: Any) -> None:
    """Adds --flag whose default comes from its PAGEDKV_* twin when that is set; with
    ``repeat`` the flag may be given several times and its value is a list."""
    twin = env_name(flag)
    raw = os.environ.get(twin)
    if repeat:
        kwargs["action"] = _Repeated
    if raw is not None:
        if repeat:
            convert = kwargs.get("type", str)
            try:
                default = [convert(item) for item in raw.split()] or None
            except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
                parser.error(f"{twin}={raw!r} is not valid for {flag}: {error}")
        elif kwargs.get("action") == "store_true":
            default = raw.strip().lower() in {"1", "true", "yes", "on"}
        else:
            convert = kwargs.get("type", str)
            try:
                default = convert(raw)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
                parser.error(f"{twin}={raw!r} is not valid for {flag}: {error}")
    shown = "" if default is None or default is False else f" (default: {default})"
    parser.add_argument(flag, default=default, help=f"{help}{shown} [env {twin}]", **kwargs)


def add_server_flags(parser: argparse.ArgumentParser, *, port: int, metrics_port: int) -> None:
    """The flags every pagedkv gRPC server shares."""
    add_flag(parser, "--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the service to the network")
    add_flag(parser, "--port", default=port, type=int, help="gRPC port (0 picks a free one)")
    add_flag(parser, "--metrics-port", default=metrics_port, type=int, help="Prometheus /metrics HTTP port (0 picks a free one, -1 disables)")
    # Its own flag: the metrics have no auth, so exposing gRPC (behind a token) must not
    # expose them too.
    add_flag(parser, "--metrics-host", default="127.0.0.1", help="address the unauthenticated /metrics port binds; "
             "0.0.0.0 only where nothing but your Prometheus reaches it")
    add_flag(parser, "--auth-token", default=None, help="shared token required as 'authorization: Bearer TOKEN' on every RPC but health")
    add_flag(parser, "--tls-cert", default=None, help="PEM certificate chain; with --tls-key serves TLS instead of plaintext")
    add_flag(parser, "--tls-key", default=None, help="PEM private key for --tls-cert")
    add_flag(parser, "--max-message-bytes", default=16 * 1024 * 1024, type=int, help="largest gRPC message accepted or sent")
    add_flag(parser, "--log-level", default="info", help="debug, info, warning or error")
    add_flag(parser, "--log-json", default=None, action="store_true", help="JSON log lines even on a terminal")
    add_flag(parser, "--port-file", default=None, help="write the bound gRPC and metrics ports here as JSON once serving (for supervisors and tests)")
