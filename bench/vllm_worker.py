"""vLLM's CPU engine, offline, driven one job at a time over stdin/stdout (JSON lines).

Runs in the vLLM venv (bench/.venv-vllm), never the project's: bench_vs_vllm.py starts it
as a child process, so the engine stays loaded across rounds and takes turns with pagedkv.

    argv: MODEL_DIR DTYPE MAX_MODEL_LEN
    stdin, one job a line:  {"requests": [[prompt_token_ids, max_new_tokens], ...]}
    stdout, one reply a line: {"seconds": s, "outputs": [[token ids], ...]}

Greedy, eos ignored, prefix caching off, token ids in and out (no tokenizer).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    model_dir, dtype, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Replies get a private copy of stdout; fd 1 becomes stderr, so whatever vLLM or its
    # engine processes (which inherit the fds) print cannot end up among the replies.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=64, enable_prefix_caching=False)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in job["requests"]]
        params = [SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, detokenize=False)
                  for _, max_new in job["requests"]]
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        outputs = [list(result.outputs[0].token_ids) for result in results]
        reply.write(json.dumps({"seconds": seconds, "outputs": outputs}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":  # vLLM's engine runs in a child process that re-imports this module
    sys.exit(main())
