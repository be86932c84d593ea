"""Multi-turn chat on SmolLM2 through the OpenAI API, with and without the cache service's KV tiers.

Conversations are served round-robin (turn 1 of every conversation, then turn 2, ...), one
request at a time, so each conversation comes back after every other one has run: the
histories together are several times what the device pool holds, and a pool-only cache
service has evicted a conversation's prefix by the time it returns. Each turn appends a
user message of 60-120 tokens (paragraphs of the Python standard library's documentation,
as installed: nothing is downloaded) and a 64-token reply. With --generate the reply is the
model's (greedy, eos ignored, max_tokens 64); by default it is 48 words of the same text
and each request asks for one token, which times the same prefill (TTFT is what is
measured) without 64 decode steps a turn: on this shared 2-core machine SmolLM2 decoded
about 0.5 token/s under load.

Configurations, each on fresh services with the same pool (--max-blocks):
  pool           the device pool only
  host           pool + --host-cache-bytes
  host+disk      pool + a smaller host tier + --disk-cache-dir
  disk-restart   the host+disk run's disk folder, after a restart of both services: the
                 same conversations again (greedy: the same histories) find them on disk

Reported per configuration: TTFT p50/p99 (streamed, to the first content chunk), prompt
tokens computed (prompt - cached, from usage), prefix hit rate (cached / prompt tokens),
tokens from the host and disk tiers, total seconds, and the share of the engine's step
time spent waiting on Lease replies (the model service's metrics; issue 23 asks for at
most 2 % with demotions in flight). With --rounds N the configurations
take turns N times (this machine is shared: compare within a round).

    .venv/bin/python bench/bench_tiers.py [--conversations 32] [--turns 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_smollm2 import real_paragraphs  # noqa: E402
from processes import start_cache_service, start_model_service  # noqa: E402

MODEL = "smollm2"
REPLY_TOKENS = 64


def user_messages(conversations: int, turns: int, seed: int = 0) -> list[list[str]]:
    """Per conversation, per turn: a user message of about 60-120 tokens (45-90 words)."""
    rng = random.Random(seed)
    words = " ".join(real_paragraphs()).split()
    out = []
    for _ in range(conversations):
        turns_text = []
        for _ in range(turns):
            count = rng.randint(45, 90)
            start = rng.randrange(len(words) - count)
            turns_text.append(" ".join(words[start : start + count]))
        out.append(turns_text)
    return out


def fixed_replies(conversations: int, turns: int, seed: int = 1) -> list[list[str]]:
    """48 words (about 64 tokens) a turn, standing in for the model's reply."""
    rng = random.Random(seed)
    words = " ".join(real_paragraphs()).split()
    out = []
    for _ in range(conversations):
        replies = []
        for _ in range(turns):
            start = rng.randrange(len(words) - 48)
            replies.append(" ".join(words[start : start + 48]))
        out.append(replies)
    return out


def run_workload(base_url: str, messages_by_conversation: list[list[str]],
                 replies_by_conversation: list[list[str]] | None, metrics_url: str | None = None) -> dict:
    import openai

    from bench_generate import metric

    def engine_seconds() -> tuple[float, float]:
        if metrics_url is None:
            return 0.0, 0.0
        return (metric(metrics_url, "pagedkv_model_lease_wait_seconds_total"),
                metric(metrics_url, "pagedkv_model_engine_step_seconds_total"))

    wait_before, step_before = engine_seconds()

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    histories = [[{"role": "system", "content": f"You are assistant number {index}. Answer briefly."}]
                 for index in range(len(messages_by_conversation))]
    ttfts, prompt_tokens, cached, cached_host, cached_disk = [], 0, 0, 0, 0
    started = time.perf_counter()
    for turn in range(len(messages_by_conversation[0])):
        for conversation, (history, messages) in enumerate(zip(histories, messages_by_conversation)):
            history.append({"role": "user", "content": messages[turn]})
            sent = time.perf_counter()
            first = None
            reply = []
            usage = None
            stream = client.chat.completions.create(
                model=MODEL, messages=history, max_tokens=1 if replies_by_conversation else REPLY_TOKENS,
                temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - sent
                    reply.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
            ttfts.append(first if first is not None else time.perf_counter() - sent)
            content = replies_by_conversation[conversation][turn] if replies_by_conversation else "".join(reply)
            history.append({"role": "assistant", "content": content})
            details = usage.prompt_tokens_details
            prompt_tokens += usage.prompt_tokens
            cached += details.cached_tokens or 0
            extra = details.model_extra or {}
            cached_host += extra.get("cached_tokens_host", 0)
            cached_disk += extra.get("cached_tokens_disk", 0)
    ttfts.sort()
    wait_after, step_after = engine_seconds()
    step = step_after - step_before
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prompt_tokens - cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "cached_host": cached_host,
        "cached_disk": cached_disk,
        "seconds": time.perf_counter() - started,
        "lease_wait_share": (wait_after - wait_before) / step if step else 0.0,
    }


def serve_and_run(tmp: Path, cache_args: list[str], model_args: list[str], messages, replies) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    with start_cache_service(tmp, *cache_args, timeout_s=300) as cache, \
            start_model_service(tmp, cache.address, "--model", MODEL, *model_args, timeout_s=600) as model:
        return run_workload(model.http_url, messages, replies, model.metrics_url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-blocks", type=int, default=160, help="the device pool, in 16-token blocks")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host-cache-bytes", default="1GiB")
    parser.add_argument("--small-host-cache-bytes", default="128MiB", help="the host tier in front of the disk")
    parser.add_argument("--disk-cache-bytes", default="4GiB")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generate", action="store_true", help="replies generated by the model (64 tokens)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    messages = user_messages(args.conversations, args.turns)
    replies = None if args.generate else fixed_replies(args.conversations, args.turns)
    pool = ["--kv-cache-bytes", "4GiB", "--max-blocks", str(args.max_blocks)]
    model_args = ["--max-model-len", str(args.max_model_len), "--threads", str(args.threads)]
    rows = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp_name:
            tmp = Path(tmp_name)
            disk = ["--disk-cache-dir", str(tmp / "disk"), "--disk-cache-bytes", args.disk_cache_bytes]
            configs = [
                ("pool", pool),
                ("host", [*pool, "--host-cache-bytes", args.host_cache_bytes]),
                ("host+disk", [*pool, "--host-cache-bytes", args.small_host_cache_bytes, *disk]),
                ("disk-restart", [*pool, "--host-cache-bytes", args.small_host_cache_bytes, *disk]),
            ]
            for name, cache_args in configs:
                row = {"round": round_index, "config": name,
                       **serve_and_run(tmp / name, cache_args, model_args, messages, replies)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.conversations} conversations x {args.turns} turns, pool {args.max_blocks} blocks of 16 tokens")
    print(f"{'config':<13} {'TTFT p50':>9} {'TTFT p99':>9} {'prefill':>8} {'hit rate':>8} {'host':>7} {'disk':>7} "
          f"{'seconds':>8} {'lease wait':>10}")
    for row in rows:
        print(f"{row['config']:<13} {row['ttft_p50_ms']:>7.0f}ms {row['ttft_p99_ms']:>7.0f}ms {row['prefill_tokens']:>8} "
              f"{row['hit_rate']:>8.1%} {row['cached_host']:>7} {row['cached_disk']:>7} {row['seconds']:>8.1f} "
              f"{row['lease_wait_share']:>10.2%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
