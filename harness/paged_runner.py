"""The engine's bookkeeping in miniature, for comparing the paged forward with transformers.

    runner = PagedRunner(model, config)
    (logits,) = runner.step([("a", prompt)], num_decode_seqs=0)     # prefill: [len, vocab]
    (logits,) = runner.step([("a", [next_token])], num_decode_seqs=1)  # one decode step

The pool starts as large random garbage and block tables are shuffled and non-contiguous, so
reading a slot that was never written, or the wrong block, shows up as wrong logits.
"""

from __future__ import annotations

import torch

from model_service.attention.metadata import AttentionMetadata
from model_service.models.config import ModelConfig
from model_service.models.lora_delta import LoraStep
from model_service.models.llama import LlamaForCausalLM, last_token_indices

BLOCK_SIZE = 4  # small, so short sequences still span several blocks
NUM_BLOCKS = 48


class PagedRunner:
    """The engine's bookkeeping in miniature: block tables, slots, metadata."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.model = model
        parameter = next(model.parameters())  # the pool holds K/V in the model's dtype, on its device
        self.device = parameter.device
        self.pool = 100.0 * torch.randn(
            (config.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
            generator=generator,
        ).to(device=self.device, dtype=parameter.dtype)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def share_prefix(self, source: str, target: str, num_tokens: int) -> None:
        """`target` starts with `source`'s first num_tokens (whole blocks), as a prefix-cache hit."""
        assert num_tokens % BLOCK_SIZE == 0
        self.tables[target] = self.tables[source][: num_tokens // BLOCK_SIZE]
        self.lengths[target] = num_tokens

    def step(self, chunks: list[tuple[str, list[int]]], num_decode_seqs: int,
             adapters: dict | None = None) -> list[torch.Tensor]:
        """Run one forward over `chunks` (decode sequences first); logits per chunk [len, vocab], on CPU.
        `adapters` maps a sequence to the LoRA adapter it runs with (others: the base)."""
        input_ids, positions, slots, context_lens = [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            for position in range(start, end):
                slots.append(table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            input_ids += tokens
            positions += range(start, end)
            context_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks) + 1  # padded past the longest
        block_tables = torch.zeros((len(chunks), width), dtype=torch.int32)
        for row, (seq, _) in enumerate(chunks):
            block_tables[row, : len(self.tables[seq])] = torch.tensor(self.tables[seq], dtype=torch.int32)
        query_lens = tuple(len(tokens) for _, tokens in chunks)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_lens=query_lens,
            context_lens_host=tuple(context_lens),
            num_decode_seqs=num_decode_seqs,
            block_size=BLOCK_SIZE,
        )
        lora = LoraStep.of_sequences(query_lens, [(adapters or {}).get(seq) for seq, _ in chunks])
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), self.pool, meta, lora,
            )
            logits = self.model.compute_logits(hidden).cpu()
            # What the engine samples from: each sequence's last row, its logits computed on
            # those rows alone, which must match the same rows of the whole step's. In a step
            # of one token a sequence (decode) those rows are all of them, in order: the same
            # product again, which a decode benchmark would count twice.
            indices = last_token_indices(query_lens)
            last = self.model.compute_logits(hidden[indices]).cpu() if len(indices) < hidden.shape[0] else None
        per_chunk = list(logits.split(query_lens))
        if last is not None:
            torch.testing.assert_close(last, torch.stack([chunk[-1] for chunk in per_chunk]))
        return per_chunk
