"""The model runner: the only part of the model service that touches the device.

It turns a scheduled batch (sequences and how many new tokens each runs) into the
tensors of one forward pass over the shared pool, and returns logits for the sequences
whose next token is due. It owns no KV memory: the pool tensor is mapped from the cache
service, and which blocks a sequence may use comes from its leased block table.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Mapping, Sequence as Seq
from typing import Any

import torch

from model_service.attention.kv_quant import pool_absmax
from pagedkv.kv_geometry import copyable
from model_service.attention.metadata import AttentionMetadata
from model_service.device_copies import to_device
from model_service.worker.decode_graphs import DecodeGraphs
from model_service.models.llama import LlamaForCausalLM, last_token_indices
from model_service.models.lora_delta import LoraStep
from model_service.sample.params import SamplingOptions
from model_service.sample.sampler import make_generator, sample
from model_service.sched.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_pool: torch.Tensor, block_size: int,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        # kv_pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        if kv_pool.shape[3] != block_size:
            raise ValueError(f"pool block size {kv_pool.shape[3]} != {block_size}")
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.device = kv_pool.device
        self.decode_graphs = decode_graphs
        # An event recorded behind the latest step's K/V writes (CUDA; None elsewhere, where
        # a step has finished writing when execute returns). A step with nothing to sample
        # never waits for the GPU, so its blocks may still be being written when the next
        # lease call commits or releases them as prefix cache: the engine calls
        # wait_for_writes before such a call (StepCycle.fence_writes).
        self.new_event: Callable[[], Any] | None = torch.cuda.Event if self.device.type == "cuda" else None
        self._writes: Any = None
        # The logits of the proposed positions of the latest step's speculating sequences.
        self.verified: dict[Sequence, torch.Tensor] = {}

    @torch.inference_mode()
    def execute(self, batch: Seq[tuple[Sequence, int]],
                prompt_logits: dict[Sequence, tuple[int, torch.Tensor]] | None = None,
                proposals: Mapping[Sequence, Seq[int]] | None = None,
                ) -> tuple[list[Sequence], torch.Tensor]:
        """Runs one step. Returns the sequences whose next token is due and their logits
        [len(due), vocab], in batch order, in the lm_head's dtype: a greedy argmax needs
        no float32 copy, and sampling.sample makes one for whatever computes with them.
        Does not change the sequences.

        `prompt_logits`, when given, names sequences (its keys) whose prompt positions in
        this step need logits (prompt logprobs); each gets (first position, logits
        [k, vocab]) for the positions of its chunk that predict a prompt token.

        `proposals`, when given, names speculating sequences: each one's entry runs its last
        token and then its proposed tokens. Its due row is its last token's (the token it
        samples as ever), and `self.verified[seq]` gets the logits [k, vocab] of the
        proposal's k positions, which the engine checks the proposal against."""
        self.verified = {}
        lora = LoraStep.of_sequences([new_tokens for _, new_tokens in batch], [seq.lora for seq, _ in batch])
        # Graphs replay base-model steps of one token a sequence only.
        if (lora is None and not prompt_logits and not proposals and self.decode_graphs is not None
                and self.decode_graphs.can_run(batch)):
            # One token a sequence: a captured graph of this batch's bucket replays the step.
            hidden = self.decode_graphs.run(batch)  # [len(batch), hidden]
            rows = list(range(len(batch)))
        else:
            input_ids, positions, meta = self.prepare(batch, proposals)
            hidden = self.model(input_ids, positions, self.kv_pool, meta, lora)  # [T, hidden]
            rows = last_token_indices([new_tokens for _, new_tokens in batch])
            if prompt_logits:
                self._prompt_logits(batch, hidden, rows, prompt_logits)
            if proposals:
                for i, (seq, _) in enumerate(batch):
                    proposal = proposals.get(seq)
                    if proposal:
                        rows[i] -= len(proposal)
                        self.verified[seq] = self.model.compute_logits(
                            hidden[rows[i] + 1:rows[i] + 1 + len(proposal)], float32=False)
        self.record_writes()
        proposed = proposals or {}
        due = [i for i, (seq, new_tokens) in enumerate(batch)
               if seq.num_computed + new_tokens == len(seq.token_ids) + len(proposed.get(seq, ()))]
        if not due:
            return [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        selected_rows = [rows[i] for i in due]
        if selected_rows == list(range(len(selected_rows))):
            # A decode step (graphs or eager): every row, in order; a slice needs no index tensor.
            selected = hidden[: len(selected_rows)]
        else:
            selected = hidden.index_select(0, to_device(selected_rows, torch.int64, self.device))
        logits = self.model.compute_logits(selected, float32=False)
        return [batch[i][0] for i in due], logits

    def record_writes(self) -> None:
        """Records the write fence behind the work enqueued so far (CUDA; nothing elsewhere)."""
        if self.new_event is not None:
            self._writes = self.new_event()
            self._writes.record(self.step_stream())

    def step_stream(self) -> Any:
        """The stream a step's work goes to: the pool's device's current stream, named, since
        a bare record() takes the calling thread's current device's, which on another device
        fences nothing. None off CUDA (a test's stand-in event records on nothing)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def wait_for_writes(self) -> None:
        """Returns once every K/V write enqueued so far has landed in the pool: call before
        a lease call commits or gives back blocks (another request or model service may
        read them at once). Waits on the latest step's event only, and once."""
        if self._writes is not None:
            self._writes.synchronize()
            self._writes = None

    def _prompt_logits(self, batch, hidden: torch.Tensor, rows: list[int],
                       wanted: dict[Sequence, tuple[int, torch.Tensor]]) -> None:
        for (seq, new_tokens), last_row in zip(batch, rows):
            if seq not in wanted:
                continue
            start = seq.num_computed
            # Position p predicts token p + 1; the prompt's last position predicts the
            # first generated token (sampled, not a prompt logprob).
            end = min(start + new_tokens, seq.prompt_len - 1)
            if end <= start:
                del wanted[seq]
                continue
            first_row = last_row - new_tokens + 1
            # The hidden rows, not their logits: [rows, vocab] float32 for a 2,048-token
            # chunk at vocab 49,152 is 400 MB (2 GB at Llama 3's vocab); the sampler turns
            # them into logprobs a slice of rows at a time (step_sampler.PROMPT_LOGPROB_ROWS).
            wanted[seq] = (start, hidden[first_row:first_row + end - start])

    @torch.inference_mode()
    def copy_blocks(self, copies: Seq[tuple[int, int]]) -> None:
        """Copy-on-write after forks: each (src, dst) block's K/V, every layer."""
        if not copies:
            return
        src = to_device([s for s, _ in copies], torch.int64, self.device)
        dst = to_device([d for _, d in copies], torch.int64, self.device)
        # kv_pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        pool = copyable(self.kv_pool)
        pool.index_copy_(2, dst, pool.index_select(2, src))

    def prepare(self, batch: Seq[tuple[Sequence, int]], proposals: Mapping[Sequence, Seq[int]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # One entry per attention row: a sequence, or one position of a speculating one.
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        num_decode = 0
        for seq, new_tokens in batch:
            start = seq.num_computed
            end = start + new_tokens
            if end > seq.capacity(block_size):
                raise RuntimeError(
                    f"request {seq.request_id}: {end} tokens scheduled but its table holds {seq.capacity(block_size)}"
                )
            input_ids.extend(seq.token_ids[start:end])
            table = seq.block_table
            if proposals and seq in proposals:  # the slice above ends at its last token
                input_ids.extend(proposals[seq])
                # Its last token and each proposed one attend as decode rows, each up to its
                # own position (their K/V are all written before any row attends): each
                # row's logits are the bits a plain decode step at that position gives, and
                # a decode-only step stays one call of the decode stack.
                for position in range(start, end):
                    if num_decode == len(query_lens):
                        num_decode += 1
                    query_lens.append(1)
                    context_lens.append(position + 1)
                    tables.append(table)
            else:
                if new_tokens == 1 and num_decode == len(query_lens):
                    num_decode += 1  # decodes lead the batch
                query_lens.append(new_tokens)
                context_lens.append(end)
                tables.append(table)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        # Exactly as wide as the longest table: on CPU, padding is gathered and costs time.
        width = max(len(table) for table in tables)
        rows = [table + [0] * (width - len(table)) for table in tables]
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, device),
            block_tables=to_device(rows, torch.int32, device),
            context_lens=to_device(context_lens, torch.int32, device),
            query_lens=tuple(query_lens),
            context_lens_host=tuple(context_lens),
            num_decode_seqs=num_decode,
            block_size=block_size,
            step_memo={},
        )
        ids = to_device(input_ids, torch.int64, device)
        pos = to_device(positions, torch.int64, device)
        return ids, pos, meta



def measure_workspace(model: LlamaForCausalLM, kv_shape_per_block: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device, block_size: int, num_tokens: int,
                      kv_absmax: list[tuple[list[float], list[float]]] | None = None,
                      max_num_seqs: int = 1, memory: PeakMemory | None = None) -> int:
    """Runs the largest step the engine can make into a scratch pool, and samples from it;
    returns the activation workspace that needed, in bytes (the scratch pool itself not
    counted). kv_absmax, when given, receives the scratch pool's per-layer largest |K| and
    |V| (the warmup scales of an 8-bit pool, attention/kv_quant.py).

    The largest step: num_tokens tokens in all (the scheduler's token budget), of which
    max_num_seqs - 1 are decode rows and the rest one prefill chunk, every row due, so the
    logits have max_num_seqs rows; then those rows are sampled as the costliest request
    would have them (warmup_sampling: on CUDA a sort of the whole vocabulary per row).
    A prefill alone missed the logits and the sampler's [rows, vocab] float32 copies, and
    the CUDA modules they load lazily, all of which came after the pool was sized.

    The warmup's token ids are spread over the vocabulary by a fixed stride rather than one
    id repeated, so those maxima see many tokens' K/V; activations' sizes do not depend on it.

    CUDA: the caching allocator keeps that memory reserved afterwards, so the cache
    service's reading of free memory already leaves room for it. CPU: the growth of the
    process's peak resident set, reported for the record.
    """
    decodes = max(min(max_num_seqs, num_tokens) - 1, 0)
    prefill_tokens = num_tokens - decodes
    prefill_blocks = -(-prefill_tokens // block_size)
    num_blocks = prefill_blocks + decodes  # a decode row's context fits one block
    scratch = torch.zeros((kv_shape_per_block[0], 2, num_blocks, block_size, *kv_shape_per_block[1:]),
                          dtype=dtype, device=device)
    vocab = model.config.vocab_size
    token_ids = [(index * 7919) % vocab for index in range(prefill_tokens + 2 * decodes)]
    batch = [(Sequence(request_id=f"warmup-decode-{row}", token_ids=token_ids[prefill_tokens + 2 * row:][:2],
                       prompt_len=1, options=None, arrival=-1, block_table=[prefill_blocks + row], num_computed=1), 1)
             for row in range(decodes)]  # decodes lead a batch (ModelRunner.prepare)
    batch.append((Sequence(request_id="warmup", token_ids=token_ids[:prefill_tokens], prompt_len=prefill_tokens,
                           options=None, arrival=-1, block_table=list(range(prefill_blocks))), prefill_tokens))
    runner = ModelRunner(model, scratch, block_size)
    options = [warmup_sampling(device)] * len(batch)
    generators = [make_generator(row, device) for row in range(len(batch))]
    memory = memory or PeakMemory(device)
    memory.start()
    due, logits = runner.execute(batch)
    sample(logits, options[: len(due)], generators[: len(due)])
    workspace = memory.growth()
    if kv_absmax is not None:
        kv_absmax.append(pool_absmax(scratch))
    del runner, scratch
    return workspace


def warmup_sampling(device: torch.device) -> SamplingOptions:
    """What the warmup samples with. CUDA: a temperature and a nucleus, the sampler's
    costliest path in memory (every row sorted in full). Elsewhere a temperature alone:
    the workspace is only reported there, and the nucleus of the warmup's near-flat
    distributions sorts every row in full on the CPU too, seconds of start-up for nothing."""
    if device.type == "cuda":
        return SamplingOptions(max_new_tokens=1, temperature=1.0, top_p=0.95)
    return SamplingOptions(max_new_tokens=1, temperature=1.0)


class PeakMemory:
    """The peak memory of the work between start() and growth(): on CUDA the caching
    allocator's peak of allocated bytes, elsewhere the process's peak resident set."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._before = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            self._before = peak_rss_bytes()

    def growth(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._before
        return max(peak_rss_bytes() - self._before, 0)


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
