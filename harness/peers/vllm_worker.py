"""vLLM's CPU engine, offline, driven one job at a time over stdin/stdout (JSON lines).

Runs in the vLLM venv (bench/.venv-vllm), never the project's: vllm_offline.py's VllmWorker starts it
as a child process, so the engine stays loaded across rounds and takes turns with pagedkv.

    argv: MODEL_DIR DTYPE MAX_MODEL_LEN [KV_CACHE_DTYPE [MAX_LORAS MAX_LORA_RANK]]
          (KV_CACHE_DTYPE auto: the compute dtype; fp8_e4m3, ...; MAX_LORAS over 0: enable_lora)
    stdin, one job a line:  {"requests": [[prompt_token_ids, max_new_tokens], ...], "logprobs": N,
                             "loras": [adapter directory or null, one per request]}
    stdout, one reply a line: {"seconds": s, "outputs": [[token ids], ...],
                               "logprobs": [[[chosen, [top N, highest first]], ...], ...]}
                          or, where vLLM refuses (its engine, or a job with LoRA): {"error": its text}

Greedy, eos ignored, prefix caching off, token ids in and out (no tokenizer). "logprobs"
is optional (0 or absent: none asked, none replied); vLLM's logprobs are its raw ones
(logprobs_mode raw_logprobs: log_softmax of the logits, as pagedkv's). "loras" is optional
too: each request's PEFT adapter directory gets its LoRARequest (one id per directory).
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


def main() -> int:
    model_dir, dtype, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kv_cache_dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
    max_loras, max_lora_rank = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (0, 0)
    # Replies get a private copy of stdout; fd 1 becomes stderr, so whatever vLLM or its
    # engine processes (which inherit the fds) print cannot end up among the replies.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank} if max_loras else {}
    try:
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                  max_num_seqs=64, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, **lora)
    except Exception as error:  # vLLM's refusal (a backend without LoRA, ...) goes to the caller
        if not lora:
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
        if logprobs:
            answer["logprobs"] = [[chosen_and_top(token, entry, logprobs) for token, entry
                                   in zip(result.outputs[0].token_ids, result.outputs[0].logprobs)]
                                  for result in results]
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":  # vLLM's engine runs in a child process that re-imports this module
    sys.exit(main())
