"""A decode step's decoder layers in one C call (cpu_kernels/csrc/decode_stack.c), for a
model whose layer linears are all held on CPU in quantized blocks or in panels of the
activations' dtype (panel_linear.py: bfloat16 or float32).

At one stream, a decode step through models/llama.py's modules is ~300 small operations,
each a dispatch (and a ctypes call for the C kernels): on a model as small as SmolLM2 those
are a large share of the step. decode_stack.c runs the same kernels in the
same order over the same buffers, so the step's results are the same bits; only the Python
between them goes.

`DecodeStack.of(model)` says whether the model qualifies (every layer linear quantized or
in panels of the activations' dtype, none with a bias; rotary tables in the
model's dtype; the default paged attention on CPU) and describes it to the C side once;
`run` then takes a decode-only step on a pool of the model's own dtype (or an 8-bit pool
under float32 activations), and answers None for anything else (a prefill, bfloat16
activations over an 8-bit pool, a batch large enough that quantized linears not all
interleaved multiply in bfloat16: quant_matmul.FLOAT_PRODUCT_TOKENS), which the per-layer
path serves.

A float32 or bfloat16 step with LoRA adapters runs in the call too, where lora_sgmv's C
kernel serves them (PAGEDKV_LORA_KERNELS; the adapters' factors in the model's dtype, as
lora/registry.py loads them): the step's runs are described by cpu_kernels/lora_runs.py, as
LoraStep describes them for the per-layer path, and the C side adds each projection's
deltas with the call (lora_runs.c) and at the point LoraStep.add_targets does.
"""

from __future__ import annotations

import ctypes

import torch

from model_service import cpu_kernels
from model_service.attention.backend import PagedAttention
from model_service.attention.metadata import AttentionMetadata
from model_service.cpu_kernels import lora_sgmv, paged_decode, quant_matmul
from model_service.cpu_kernels.build import DTYPE_CODES, KV_DTYPE_CODES
from model_service.models.lora_delta import LoraStep
from model_service.models.panel_linear import PanelLinear
from model_service.models.quantized_linear import QuantizedLinear
from pagedkv.kv_geometry import is_fp8

MAX_SEGMENTS = 4  # decode_stack.c's STACK_MAX_SEGMENTS
# decode_stack.c's STACK_BF16_PANELS and STACK_F32_PANELS, by the panels' dtype
PANELS = {torch.bfloat16: 0x1000, torch.float32: 0x1001}


class _Linear(ctypes.Structure):
    _fields_ = [("segments", ctypes.c_int32), ("types", ctypes.c_int32 * MAX_SEGMENTS),
                ("rows", ctypes.c_int32 * MAX_SEGMENTS), ("weights", ctypes.c_int64 * MAX_SEGMENTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_int64), ("post_attention_norm", ctypes.c_int64),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("sliding_window", ctypes.c_int32), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("q_heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("block_size", ctypes.c_int32), ("level", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("final_norm", ctypes.c_int64), ("cos_table", ctypes.c_int64), ("sin_table", ctypes.c_int64),
                ("layers", ctypes.POINTER(_Layer)), ("bf16_level", ctypes.c_int32), ("f32_level", ctypes.c_int32)]


def _linear(module) -> _Linear | None:
    if isinstance(module, PanelLinear) and module.bias is None:
        described = _Linear(segments=1)
        described.types[0], described.rows[0] = PANELS[module.panels.dtype], module.out_features
        described.weights[0] = module.panels.data_ptr()
        return described
    if not isinstance(module, QuantizedLinear) or module.bias is not None \
            or len(module.segments.parts) > MAX_SEGMENTS:
        return None
    segments = module.segments
    count = len(segments.parts)
    described = _Linear(segments=count)
    for index in range(count):
        described.types[index] = segments.types[index]
        described.rows[index] = segments.row_counts[index]
        described.weights[index] = segments.pointers[index]
    return described


class DecodeStack:
    """The model described to decode_stack.c (weights by pointer: the model must outlive it)."""

    def __init__(self, model, library: ctypes.CDLL, layers: ctypes.Array, scaled: bool, any_batch: bool,
                 quant_level: int, panel_level: int) -> None:
        config = model.config
        self.model, self.library, self._layers = model, library, layers  # _layers: kept alive for the C side
        self.scaled = scaled  # the layers' 8-bit pool scales were set (an 8-bit pool is what it takes then)
        # every linear's product the same kernel at any batch, as the per-layer path has it:
        # panels, or quantized rows all interleaved (integer products)
        self.any_batch = any_batch
        self.dtype = model.norm.weight.dtype
        self._described = _Model(
            num_layers=config.num_layers, hidden=config.hidden_size, q_heads=config.num_heads,
            kv_heads=config.num_kv_heads, head_dim=config.head_dim, intermediate=config.intermediate_size,
            dtype=DTYPE_CODES[self.dtype], block_size=0, level=quant_level,
            eps=config.rms_norm_eps, scale=config.head_dim ** -0.5,
            final_norm=model.norm.weight.data_ptr(), cos_table=model.rotary.cos_cache.data_ptr(),
            sin_table=model.rotary.sin_cache.data_ptr(), layers=layers,
            bf16_level=panel_level if self.dtype == torch.bfloat16 else 0,
            f32_level=panel_level if self.dtype == torch.float32 else 0)

    @classmethod
    def of(cls, model) -> DecodeStack | None:
        """The model's stack, or None where it does not qualify (see the module's doc)."""
        library = cpu_kernels.load()
        norm_dtype = model.norm.weight.dtype
        if library is None or norm_dtype not in DTYPE_CODES or model.norm.weight.device.type != "cpu":
            return None
        config = model.config
        if config.head_dim > paged_decode.MAX_HEAD_DIM or config.num_heads % config.num_kv_heads \
                or config.num_heads // config.num_kv_heads > paged_decode.MAX_GROUP:
            return None
        rotary = model.rotary
        if rotary.cos_cache.dtype != norm_dtype or not rotary.cos_cache.is_contiguous() \
                or not rotary.sin_cache.is_contiguous():
            return None
        described, any_batch, quantized, panel_levels = [], True, False, set()
        for layer in model.layers:
            attention = layer.self_attn
            if not isinstance(attention.attention, PagedAttention) or attention.attention.backend not in ("auto", "cpu"):
                return None
            modules = (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            linears = [_linear(module) for module in modules]
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(linear is None for linear in linears) or any(
                    norm.dtype != norm_dtype or not norm.is_contiguous() for norm in norms):
                return None
            for module in modules:
                if isinstance(module, PanelLinear):
                    if module.panels.dtype != norm_dtype:  # panels take activations of their dtype
                        return None
                    panel_levels.add(module.level)
                else:
                    quantized = True
                    any_batch = any_batch and module.segments.interleaved
            k_scale, v_scale = attention.kv_scales or (1.0, 1.0)
            described.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(), *linears,
                                    attention.sliding_window or 0, k_scale, v_scale))
        # One level serves the whole call.
        if len(panel_levels) > 1:
            return None
        # An 8-bit pool's scales are described too: set_kv_scales drops the stack, so a new
        # set is described again at the next step.
        scaled = model.layers[0].self_attn.kv_scales is not None
        return cls(model, library, (_Layer * len(described))(*described), scaled, any_batch,
                   quant_matmul.chosen_level(library) if quantized else 0, panel_levels.pop() if panel_levels else 0)

    def points_at(self, model) -> bool:
        """Whether the weights described are still where `model` holds them (a `.to()` moves
        the norms and rotary tables; the quantized blocks never move)."""
        return (self._described.final_norm == model.norm.weight.data_ptr()
                and self._described.cos_table == model.rotary.cos_cache.data_ptr()
                and self._layers[0].input_norm == model.layers[0].input_layernorm.weight.data_ptr())

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor,
            meta: AttentionMetadata, lora: LoraStep | None = None) -> torch.Tensor | None:
        """The final norm's output [T, hidden] for a decode-only step, `hidden` (the
        embeddings, [T, hidden] contiguous) used as the residual stream, with the deltas of
        `lora`'s adapters; None where this step is not one the stack takes."""
        tokens = hidden.shape[0]
        lora_runs, lora_level = self._lora_runs(lora)
        if lora is not None and lora_runs is None:
            return None
        fp8 = is_fp8(kv_pool.dtype)
        if (meta.num_decode_seqs != tokens
                or (tokens >= quant_matmul.FLOAT_PRODUCT_TOKENS and not self.any_batch)  # products in bfloat16
                or not kv_pool.is_contiguous() or kv_pool.device.type != "cpu"
                or not hidden.is_contiguous() or hidden.dtype != self.dtype
                or meta.block_size > paged_decode.MAX_BLOCK_SIZE
                # an 8-bit pool is read with float32 activations (paged_decode_attention), and
                # needs the scales; any other pool holds the activations' own dtype
                or (fp8 and (self.dtype != torch.float32 or not self.scaled))
                or (not fp8 and (kv_pool.dtype != self.dtype or self.scaled))):
            return None
        tables = meta.block_tables[:tokens]
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        lens = meta.context_lens[:tokens].to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        self._described.block_size = meta.block_size
        out = torch.empty_like(hidden)
        status = self.library.decode_stack(
            ctypes.addressof(self._described), hidden.data_ptr(), out.data_ptr(), tokens, positions.data_ptr(),
            slots.data_ptr(), kv_pool.data_ptr(), kv_pool.shape[2], tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), KV_DTYPE_CODES[kv_pool.dtype], lora_runs, len(lora_runs) if lora_runs else 0,
            lora_level, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"decode_stack failed ({status})")
        return out

    def _lora_runs(self, lora: LoraStep | None) -> tuple[ctypes.Array | None, int]:
        """The step's runs described for the C side (lora_runs.py, as the per-layer path
        describes them) and the LoRA kernel's level; (None, 0) without adapters, or where the
        C kernel does not serve them (then the per-layer path adds them)."""
        if lora is None:
            return None, 0
        level = lora_sgmv.chosen_level()
        if level is None or self.dtype not in lora_sgmv.DTYPES:
            return None, 0
        runs = lora.cpu_runs(self.dtype)
        return (runs, level) if runs is not None else (None, 0)
