"""Command-line client for the model service.

    python -m model_service.client "Once upon a time" --max-new-tokens 32
    python -m model_service.client --token-ids 1,2,3 --temperature 0.8 --seed 7 --json
    python -m model_service.client --chat "What is the capital of France?"
    python -m model_service.client --system "You are a concise assistant." "Name three primary colors."
    python -m model_service.client --info

Text streams to stdout as it arrives; a usage line goes to stderr at the end. `--json`
prints each GenerateResponse (or the model info) as one JSON line instead. A failed call
prints the gRPC status code and details to stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
AUTH_TOKEN_ENV = "PAGEDKV_AUTH_TOKEN"


def _token_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,3, got {value!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids needs at least one token id")
    if any(not 0 <= token_id < 2**32 for token_id in ids):
        raise argparse.ArgumentTypeError("token ids must be in [0, 2**32)")
    return ids


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model_service.client",
        description="Generate text with a pagedkv model service, or show its model info.",
    )
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --token-ids)")
    parser.add_argument("--token-ids", type=_token_ids, metavar="1,2,3",
                        help="prompt as comma-separated token ids instead of text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as one user message, rendered by the model's chat template")
    parser.add_argument("--system", metavar="TEXT",
                        help="a system message before the user message (implies --chat)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="tokens to generate (default: the service's default)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (default 0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default 0)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, help="same seed, same output")
    parser.add_argument("--stop", action="append", default=[], metavar="STR",
                        help="stop string (repeatable); not included in the output")
    parser.add_argument("--stop-token-id", action="append", type=int, default=[],
                        metavar="ID", help="stop token id (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token")
    parser.add_argument("--request-id", default="", help="request id (default: the service picks)")
    parser.add_argument("--json", action="store_true",
                        help="print each response message as one JSON line")
    parser.add_argument("--info", action="store_true", help="print the model info and exit")
    parser.add_argument("--address", default=DEFAULT_ADDRESS,
                        help=f"model service host:port (default {DEFAULT_ADDRESS})")
    parser.add_argument("--auth-token", default=os.environ.get(AUTH_TOKEN_ENV),
                        help=f"bearer token (default: ${AUTH_TOKEN_ENV})")
    parser.add_argument("--tls-ca", metavar="PATH",
                        help="CA certificate (PEM) to verify the server; enables TLS")
    parser.add_argument("--timeout", type=_positive_float, metavar="SECONDS",
                        help="deadline for the whole call")
    return parser


def build_request(args: argparse.Namespace) -> model_pb2.GenerateRequest:
    sampling = model_pb2.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
    )
    # Optional fields are set only when given, so the service applies its defaults.
    if args.max_new_tokens is not None:
        sampling.max_new_tokens = args.max_new_tokens
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.chat or args.system is not None:
        system = [] if args.system is None else [model_pb2.ChatMessage(role="system", content=args.system)]
        return model_pb2.GenerateRequest(
            request_id=args.request_id,
            messages=[*system, model_pb2.ChatMessage(role="user", content=args.prompt or "")],
            sampling=sampling,
        )
    return model_pb2.GenerateRequest(
        request_id=args.request_id,
        prompt=args.prompt or "",
        prompt_token_ids=args.token_ids or [],
        sampling=sampling,
    )


def open_channel(address: str, tls_ca: str | None) -> grpc.Channel:
    if tls_ca is None:
        return grpc.insecure_channel(address)
    with open(tls_ca, "rb") as ca_file:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read())
    return grpc.secure_channel(address, credentials)


def _message_json(message) -> str:
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True))


def _print_info(stub: model_pb2_grpc.ModelServiceStub, args, metadata) -> None:
    info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), metadata=metadata,
                             timeout=args.timeout)
    if args.json:
        print(_message_json(info), flush=True)
        return
    fields = json_format.MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for name, value in fields.items():
        if isinstance(value, list):
            value = ",".join(str(item) for item in value)
        print(f"{name}: {value}")
    sys.stdout.flush()


def _generate(stub: model_pb2_grpc.ModelServiceStub, args, metadata) -> None:
    call = stub.Generate(build_request(args), metadata=metadata, timeout=args.timeout)
    last_text = ""
    finish_reason = model_pb2.FINISH_REASON_UNSPECIFIED
    usage = model_pb2.Usage()
    try:
        for response in call:
            if args.json:
                sys.stdout.write(_message_json(response) + "\n")
            elif response.text:
                sys.stdout.write(response.text)
                last_text = response.text
            sys.stdout.flush()
            if response.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
                finish_reason = response.finish_reason
            if response.HasField("usage"):
                usage = response.usage
    except KeyboardInterrupt:
        call.cancel()  # frees the request's KV blocks on the service at once
        raise
    if not args.json and last_text and not last_text.endswith("\n") and sys.stdout.isatty():
        sys.stdout.write("\n")
        sys.stdout.flush()
    reason = model_pb2.FinishReason.Name(finish_reason).removeprefix("FINISH_REASON_")
    print(
        f"[prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
        f"cached_tokens={usage.cached_tokens} finish_reason={reason}]",
        file=sys.stderr,
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)
    if not args.info and (args.prompt is None) == (args.token_ids is None):
        parser.print_usage(sys.stderr)
        print("error: give exactly one of a prompt or --token-ids (or --info)", file=sys.stderr)
        return 2
    if (args.chat or args.system is not None) and args.token_ids is not None:
        parser.print_usage(sys.stderr)
        print("error: --chat and --system take a text prompt, not --token-ids", file=sys.stderr)
        return 2
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    try:
        channel = open_channel(args.address, args.tls_ca)
    except OSError as error:
        print(f"error: cannot read --tls-ca {args.tls_ca}: {error.strerror}", file=sys.stderr)
        return 1
    try:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        if args.info:
            _print_info(stub, args, metadata)
        else:
            _generate(stub, args, metadata)
    except grpc.RpcError as error:
        sys.stdout.flush()
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
