"""vLLM's CPU engine, offline, driven one job at a time over stdin/stdout (JSON lines).

Runs in the vLLM venv (bench/.venv-vllm), never the project's: vllm_offline.py's VllmWorker starts it
as a child process, so the engine stays loaded across rounds and takes turns with pagedkv.

    argv: MODEL_DIR DTYPE MAX_MODEL_LEN [KV_CACHE_DTYPE [ENGINE_JSON]]
          (KV_CACHE_DTYPE auto: the compute dtype; fp8_e4m3, ...; ENGINE_JSON: more LLM(...)
          arguments, e.g. {"enable_lora": true, "max_loras": 8, "max_lora_rank": 16} or
          {"max_num_seqs": 8, "speculative_config": {"method": "ngram", ...}})
    stdin, one job a line:  {"requests": [[prompt_token_ids, max_new_tokens], ...], "logprobs": N,
                             "loras": [adapter directory or null, one per request]}
    stdout, one reply a line: {"seconds": s, "outputs": [[token ids], ...],
                               "logprobs": [[[chosen, [top N, highest first]], ...], ...],
                               "spec": [draft tokens, accepted tokens]}
                          or, where vLLM refuses (the engine ENGINE_JSON asks for, or a job with
                          LoRA): {"error": its text}

Greedy, eos ignored, prefix caching off, token ids in and out (no tokenizer). "logprobs"
is optional (0 or absent: none asked, none replied); vLLM's logprobs are its raw ones
(logprobs_mode raw_logprobs: log_softmax of the logits, as pagedkv's). "loras" is optional
too: each request's PEFT adapter directory gets its LoRARequest (one id per directory).
"spec" comes only with a speculative_config: the job's share of vLLM's spec-decode counters
(LLM.get_metrics, so its stats are on for that engine alone).
"""

from __future__ import annotations

import json
import os
import sys
import time


def chosen_and_top(token: int, entry: dict, count: int) -> list:
    """[the chosen token's logprob, the top `count` logprobs, highest first]: vLLM's entry
    holds the top `count` and the chosen token (a third entry where it is not among them)."""
    ranked = sorted(entry.values(), key=lambda logprob: logprob.rank)
    return [entry[token].logprob, [logprob.logprob for logprob in ranked[:count]]]


def spec_counts(llm) -> tuple[int, int]:
    """(draft tokens, accepted tokens) vLLM's spec-decode counters hold so far."""
    counts = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    return (int(counts.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(counts.get("vllm:spec_decode_num_accepted_tokens", 0)))


def main() -> int:
    model_dir, dtype, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kv_cache_dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
    engine = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    speculating = "speculative_config" in engine
    # Replies get a private copy of stdout; fd 1 becomes stderr, so whatever vLLM or its
    # engine processes (which inherit the fds) print cannot end up among the replies.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    options = dict(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                   max_num_seqs=64, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
                   disable_log_stats=not speculating)
    try:
        llm = LLM(**{**options, **engine})
    except Exception as error:  # vLLM's refusal (a backend without LoRA or speculation, ...) goes to the caller
        if not engine:
            raise
        reply.write(json.dumps({"ready": False, "error": f"{type(error).__name__}: {error}"}) + "\n")
        reply.flush()
        return 1
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    lora_ids: dict[str, int] = {}  # a LoRARequest's id names its adapter: one per directory
    for line in sys.stdin:
        job = json.loads(line)
        loras = [None if path is None else LoRARequest(path, lora_ids.setdefault(path, len(lora_ids) + 1), path)
                 for path in job.get("loras") or []] or None
        logprobs = job.get("logprobs") or None
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in job["requests"]]
        params = [SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, detokenize=False,
                                 logprobs=logprobs)
                  for _, max_new in job["requests"]]
        before = spec_counts(llm) if speculating else None
        started = time.perf_counter()
        try:
            results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        except Exception as error:  # as at start: a refused LoRA job is told, not a crash
            if loras is None:
                raise
            reply.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
            reply.flush()
            continue
        seconds = time.perf_counter() - started
        outputs = [list(result.outputs[0].token_ids) for result in results]
        answer = {"seconds": seconds, "outputs": outputs}
        if before is not None:
            answer["spec"] = [after - earlier for after, earlier in zip(spec_counts(llm), before)]
        if logprobs:
            answer["logprobs"] = [[chosen_and_top(token, entry, logprobs) for token, entry
                                   in zip(result.outputs[0].token_ids, result.outputs[0].logprobs)]
                                  for result in results]
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":  # vLLM's engine runs in a child process that re-imports this module
    sys.exit(main())
