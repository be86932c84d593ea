"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV pool, in plain PyTorch.

The model holds weights only: no per-request state. Every forward pass gets the step's
tokens flattened ([T], decode sequences first, then prefill chunks), their positions,
the whole pool and the step's AttentionMetadata; PagedAttention writes this step's K/V
into the pool and attends over each sequence's blocks.

Projections are fused for speed (one matmul instead of three, or two): q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`; loading/hf_weights.py maps Hugging Face names
into them (loading/gguf_weights.py GGUF's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from model_service.attention.metadata import AttentionMetadata
from model_service.models import fused_ops
from model_service.models.config import ModelConfig
from model_service.models.fused_ops import RotaryStep
from model_service.models.lora_delta import LoraStep
from model_service.models.rope import RotaryEmbedding

# (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], kv_layer [2, NB, BS, Hkv, D], meta, scale,
#  sliding_window=int | None) -> [T, Hq, D]
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, hidden: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, its norm): a residual add and the norm after it in one pass."""
        return fused_ops.add_rms_norm(hidden, delta, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.sliding_window = config.window_of(layer_index)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.attention = attention
        # (k_scale, v_scale) of an 8-bit pool (attention/kv_quant.py), set once before
        # serving by set_kv_scales; None: the pool holds K/V as they are.
        self.kv_scales: tuple[float, float] | None = None

    def forward(self, hidden: torch.Tensor, rotary: RotaryStep, kv_layer: torch.Tensor,
                meta: AttentionMetadata, lora: LoraStep | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) D]
        if lora is not None:
            lora.add_targets(qkv, hidden, self.layer_index,
                             (("q_proj", 0), ("k_proj", self.q_size), ("v_proj", self.q_size + self.kv_size)))
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # q and k heads rotated in one call (in place on the C path).
        qk = rotary.rotate(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)  # q: [T, Hq, D], k: [T, Hkv, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # v: [T, Hkv, D]
        if self.kv_scales is None:
            out = self.attention(q, k, v, kv_layer, meta, self.scale, sliding_window=self.sliding_window)  # [T, Hq, D]
        else:
            out = self.attention(q, k, v, kv_layer, meta, self.scale, sliding_window=self.sliding_window,
                                 kv_scales=self.kv_scales)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)  # [T, hidden]
        if lora is not None:
            lora.add(projected, out, self.layer_index, "o_proj")
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))  # [T, 2 I] -> [T, I] -> [T, hidden]
        gate_up = self.gate_up_proj(x)
        lora.add_targets(gate_up, x, self.layer_index, (("gate_proj", 0), ("up_proj", self.intermediate_size)))
        activated = fused_ops.silu_mul(gate_up)
        out = self.down_proj(activated)
        lora.add(out, activated, self.layer_index, "down_proj")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionFn, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, attention, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_index)

    def forward(self, hidden: torch.Tensor, pending: torch.Tensor | None, rotary: RotaryStep,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                lora: LoraStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (residual stream, this layer's MLP output still to add to it): the add is
        left to the next norm, which fuses it (`pending`; None before the first layer)."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_and_norm(hidden, pending)
        hidden, normed = self.post_attention_layernorm.add_and_norm(
            hidden, self.self_attn(normed, rotary, kv_layer, meta, lora))
        return hidden, self.mlp(normed, lora)


class LlamaForCausalLM(nn.Module):
    """`attention` defaults to PagedAttention(backend=attention_backend); pass any callable
    with the same signature to run another implementation."""

    def __init__(
        self, config: ModelConfig, *, attention: AttentionFn | None = None, attention_backend: str = "auto"
    ) -> None:
        super().__init__()
        if attention is None:
            attention = default_attention(attention_backend)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, attention, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Decode-only steps of a model with quantized or panel linears on CPU run their layers in one
        # C call (cpu_decode_stack.py) when this is True; built at the first such step.
        self.decode_stack_enabled = True
        self._decode_stack = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        # input_ids, positions: [T] int64; kv_pool: [L, 2, NB, BS, Hkv, D] -> hidden [T, hidden]
        # lora: the step's rows of LoRA adapters (lora_delta.py), None when all are the base's.
        hidden = self.embed_tokens(input_ids)  # [T, hidden], the residual stream (added to in place)
        # The one-call C decode stack adds float32 and bfloat16 adapters' deltas itself; where
        # it cannot (float16, torch's LoRA products), the step runs layer by layer.
        if self.decode_stack_enabled and meta.num_decode_seqs == hidden.shape[0] and hidden.device.type == "cpu":
            stack = self._current_decode_stack()
            normed = stack.run(hidden, positions, kv_pool, meta, lora) if stack else None
            if normed is not None:
                return normed
        rotary = RotaryStep(self.rotary.cos_cache, self.rotary.sin_cache, positions)
        pending = None
        for layer_index, layer in enumerate(self.layers):
            hidden, pending = layer(hidden, pending, rotary, kv_pool[layer_index], meta, lora)
        return self.norm.add_and_norm(hidden, pending)[1]

    def _current_decode_stack(self):
        """The model's DecodeStack, or False where it does not qualify: built once, again
        only if the weights it points at moved (a `.to()` after the first step)."""
        stack = self._decode_stack
        if stack is None or (stack and not stack.points_at(self)):
            from model_service.models.cpu_decode_stack import DecodeStack  # imports the attention package
            stack = self._decode_stack = DecodeStack.of(self) or False
        return stack

    def set_kv_scales(self, scales: Sequence[tuple[float, float]] | None) -> None:
        """Each layer's (k_scale, v_scale) for an 8-bit pool; None for a pool of K/V as they are."""
        if scales is not None and len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} KV scales for {len(self.layers)} layers")
        for index, layer in enumerate(self.layers):
            layer.self_attn.kv_scales = None if scales is None else tuple(scales[index])
        self._decode_stack = None  # described again, with these scales, at the next decode step

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        # hidden: [N, hidden] (only the rows whose next token is wanted) -> [N, vocab], float32
        # or (float32=False) in the lm_head's dtype, for a caller that converts only when needed
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits


def default_attention(backend: str = "auto") -> AttentionFn:
    # Imported here so the model module loads (and can be tested with another attention)
    # wherever the attention package is unavailable.
    from model_service.attention.backend import PagedAttention

    return PagedAttention(backend=backend)


def last_token_indices(query_lens: Sequence[int]) -> list[int]:
    """Row of each sequence's last new token in the flattened step: the rows to take
    logits from (`model.compute_logits(hidden[indices])`)."""
    indices, end = [], 0
    for query_len in query_lens:
        end += query_len
        indices.append(end - 1)
    return indices
