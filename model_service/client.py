"""Command-line client for the model service.

    python -m model_service.client "Once upon a time" --max-new-tokens 32
    python -m model_service.client --token-ids 1,2,3 --temperature 0.8 --seed 7 --json
    python -m model_service.client "Once upon a time" --n 3 --temperature 1 --seed 7 --logprobs 2
    python -m model_service.client "Say hi" --repetition-penalty 1.2 --min-p 0.05 --logit-bias 42=-100
    python -m model_service.client --abort my-request-id
    python -m model_service.client --chat "What is the capital of France?"
    python -m model_service.client --system "You are a concise assistant." "Name three primary colors."
    python -m model_service.client --info

Text streams to stdout as it arrives (with --n above 1, each completion is printed whole
once the stream ends); a usage line goes to stderr at the end, and with --logprobs one
line per token. `--json` prints each GenerateResponse (or the model info) as one JSON
line instead. A failed call
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


def _logit_bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS like 42=-100, got {value!r}") from None


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
    parser.add_argument("--n", type=int, default=0, help="completions of the prompt (default 1)")
    parser.add_argument("--logprobs", type=int, metavar="N",
                        help="the sampled token's logprob and the top N alternatives (0-20)")
    parser.add_argument("--prompt-logprobs", type=int, metavar="N",
                        help="logprobs of the prompt tokens and their top N alternatives (0-20)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0)")
    parser.add_argument("--repetition-penalty", type=float, help="transformers' and vLLM's, > 0 (1 is off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one's probability")
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token id before this many tokens")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="ID=BIAS",
                        help="add BIAS (in [-100, 100]) to token ID's logit (repeatable)")
    parser.add_argument("--include-stop-str", action="store_true",
                        help="keep the matched stop string at the end of the text")
    parser.add_argument("--keep-special-tokens", action="store_true",
                        help="leave special tokens (eos, chat markers) in the text")
    parser.add_argument("--no-stream", action="store_true",
                        help="ask for each completion whole, in one message when it ends (GenerateRequest.stream)")
    parser.add_argument("--priority", type=int, default=0,
                        help="lower runs first when the service runs --scheduling-policy priority")
    parser.add_argument("--abort", action="append", metavar="REQUEST_ID",
                        help="abort the named live request (repeatable) and exit")
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
        n=args.n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        logit_bias=dict(args.logit_bias),
        include_stop_str_in_output=args.include_stop_str,
    )
    # Optional fields are set only when given, so the service applies its defaults.
    for name in ("logprobs", "prompt_logprobs", "repetition_penalty"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    if args.keep_special_tokens:
        sampling.skip_special_tokens = False
    if args.max_new_tokens is not None:
        sampling.max_new_tokens = args.max_new_tokens
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    request = model_pb2.GenerateRequest(request_id=args.request_id, sampling=sampling, priority=args.priority)
    if args.chat or args.system is not None:
        if args.system is not None:
            request.messages.add(role="system", content=args.system)
        request.messages.add(role="user", content=args.prompt or "")
    else:
        request.prompt = args.prompt or ""
        request.prompt_token_ids.extend(args.token_ids or [])
    if args.no_stream:
        request.stream = False
    return request


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
    several = args.n > 1
    last_text = ""
    texts: dict[int, list[str]] = {}
    finishes: dict[int, str] = {}
    logprobs: list[tuple[int, model_pb2.TokenLogprob]] = []
    prompt_logprobs: list[model_pb2.TokenLogprob] = []
    usage = model_pb2.Usage()
    try:
        for response in call:
            if args.json:
                sys.stdout.write(_message_json(response) + "\n")
            elif several:
                texts.setdefault(response.index, []).append(response.text)
            elif response.text:
                sys.stdout.write(response.text)
                last_text = response.text
            sys.stdout.flush()
            logprobs.extend((response.index, entry) for entry in response.logprobs)
            prompt_logprobs.extend(response.prompt_logprobs)
            if response.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED:
                finishes[response.index] = model_pb2.FinishReason.Name(response.finish_reason).removeprefix(
                    "FINISH_REASON_")
                # Each completion's last message has its own completion_tokens; the prompt
                # is counted in one of them only.
                usage.prompt_tokens += response.usage.prompt_tokens
                usage.completion_tokens += response.usage.completion_tokens
                usage.cached_tokens += response.usage.cached_tokens
    except KeyboardInterrupt:
        call.cancel()  # frees the request's KV blocks on the service at once
        raise
    if several and not args.json:
        for index in sorted(texts):
            last_text = "".join(texts[index])
            sys.stdout.write(f"--- completion {index} ---\n{last_text}\n")
        last_text = "\n"
    if not args.json and last_text and not last_text.endswith("\n") and sys.stdout.isatty():
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.json:
        for position, entry in enumerate(prompt_logprobs, start=1):
            print(f"prompt[{position}] {_logprob_text(entry)}", file=sys.stderr)
        for index, entry in logprobs:
            print(f"[{index}] {_logprob_text(entry)}", file=sys.stderr)
    reason = ",".join(finishes[index] for index in sorted(finishes)) or "UNSPECIFIED"
    print(
        f"[prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
        f"cached_tokens={usage.cached_tokens} finish_reason={reason}]",
        file=sys.stderr,
        flush=True,
    )


def _logprob_text(entry: model_pb2.TokenLogprob) -> str:
    top = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in entry.top)
    return f"token={entry.token_id} logprob={entry.logprob:.4f}" + (f" top={top}" if top else "")


def _abort(stub: model_pb2_grpc.ModelServiceStub, args, metadata) -> None:
    reply = stub.Abort(model_pb2.AbortRequest(request_ids=args.abort), metadata=metadata, timeout=args.timeout)
    print(f"aborted: {reply.aborted} of {len(args.abort)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return int(exit_.code or 0)
    if not args.info and not args.abort and (args.prompt is None) == (args.token_ids is None):
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
        elif args.abort:
            _abort(stub, args, metadata)
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
