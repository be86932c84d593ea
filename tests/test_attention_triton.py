"""The Triton kernels, run on CPU by Triton's interpreter, against the PyTorch path.

In an ordinary run this module holds one test, which runs this same file in a child under
the interpreter (tests/triton_interpreter.py says why a subprocess); there the kernel tests
below are defined and run in-process.

Shapes stay small: the interpreter runs one program at a time, in Python;
the long-context cases use two sequences and at most two kv heads.
"""

from __future__ import annotations

import pytest

from triton_interpreter import IN_INTERPRETER, run_file

if not IN_INTERPRETER:

    # The interpreter runs every kernel in Python: minutes on a loaded 2-core machine. The
    # bounds only end a hang.
    @pytest.mark.timeout(1200)
    def test_triton_kernels_under_interpreter():
        run_file(__file__, timeout=1100)

else:
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from model_service.attention import AttentionMetadata, PagedAttention
    from model_service.attention import triton_kernels
    from model_service.attention.torch_paged import decode_attention_torch, write_kv_torch
    from model_service.attention.triton_kernels import decode_attention_triton, write_kv_triton

    # Fail loudly (not with odd pointer errors) if the kernels were built before the env var.
    assert isinstance(triton_kernels._decode_kernel, InterpretedFunction), "kernels imported before TRITON_INTERPRET=1"

    DTYPES = [torch.float32, torch.float16, torch.bfloat16]
    # Both sides round their output to the dtype: allow a couple of its units.
    TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    KV_HEADS, HEAD_DIM = 2, 16

    def random_pool(num_blocks, block_size, dtype, seed, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype), generator

    def shuffled_tables(context_lens, block_size, num_blocks, generator, extra_columns=1):
        """Non-contiguous, shuffled block ids; rows padded with 0 like the engine's."""
        needed = [-(-n // block_size) for n in context_lens]
        ids = torch.randperm(num_blocks, generator=generator).tolist()
        tables = torch.zeros(len(context_lens), max(needed) + extra_columns, dtype=torch.int32)
        for row, count in enumerate(needed):
            tables[row, :count] = torch.tensor([ids.pop() for _ in range(count)], dtype=torch.int32)
        return tables

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_write_kv_matches_torch_and_skips_padding(dtype):
        kv_triton, generator = random_pool(10, 8, dtype, seed=1)
        kv_torch = kv_triton.clone()
        k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        slots = torch.tensor([3, 17, 40, 79, 8])
        write_kv_triton(k, v, kv_triton, slots)
        write_kv_torch(k, v, kv_torch, slots)
        assert torch.equal(kv_triton, kv_torch)
        # A padding token (slot -1) writes nothing.
        before = kv_triton.clone()
        write_kv_triton(k[:1] * 0 + 7, v[:1], kv_triton, torch.tensor([-1]))
        assert torch.equal(kv_triton, before)

    def test_write_kv_into_layer_view_with_odd_head_count():
        # kv_pool[layer] is a strided view; 3 heads and head_dim 12 exercise the padded tiles.
        pool = torch.zeros(2, 2, 4, 8, 3, 12)
        k, v = torch.randn(3, 3, 12), torch.randn(3, 3, 12)
        write_kv_triton(k, v, pool[1], torch.tensor([0, 9, 31]))
        expected = torch.zeros(2, 2, 4, 8, 3, 12)
        write_kv_torch(k, v, expected[1], torch.tensor([0, 9, 31]))
        assert torch.equal(pool, expected)

    # Each (block size, group) pair once, the dtypes taken in turn: each dtype meets both block
    # sizes and two groups, without the interpreter running every crossing.
    DECODE_CASES = [(16, 1, torch.float32), (16, 2, torch.float16), (16, 4, torch.bfloat16),
                    (8, 1, torch.bfloat16), (8, 2, torch.float32), (8, 4, torch.float16)]

    @pytest.mark.parametrize(("block_size", "group", "dtype"), DECODE_CASES, ids=str)
    def test_decode_matches_torch(block_size, group, dtype):
        context_lens = [1, block_size, block_size + 1, 3 * block_size - 2]
        kv_layer, generator = random_pool(16, block_size, dtype, seed=group * 100 + block_size)
        tables = shuffled_tables(context_lens, block_size, 16, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), KV_HEADS * group, HEAD_DIM, generator=generator).to(dtype)

        out = decode_attention_triton(q, kv_layer, tables, lens, HEAD_DIM**-0.5)

        expected = decode_attention_torch(q, kv_layer, tables, lens, HEAD_DIM**-0.5)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    # (kv_heads, group, head_dim): groups that are not a power of two pad GROUP_PAD rows that
    # must be masked (Qwen2-1.5B has group 6, Qwen2-7B group 7); group 1 is full MHA.
    SERVED_SHAPES = [(1, 3, 64), (1, 6, 128), (1, 7, 64), (2, 7, 128), (3, 1, 64), (2, 1, 128)]

    # Both dtypes over the shapes, not every pair: each meets both head dims, padded groups and
    # full MHA.
    SERVED_DTYPES = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]

    @pytest.mark.parametrize(("shape", "dtype"), list(zip(SERVED_SHAPES, SERVED_DTYPES)),
                             ids=lambda c: f"kv{c[0]}-g{c[1]}-d{c[2]}" if isinstance(c, tuple) else str(c))
    def test_decode_served_gqa_groups_over_many_blocks(shape, dtype):
        # Contexts across 10-15 shuffled blocks, each ending mid-block; few sequences and heads,
        # since the interpreter runs one program at a time.
        kv_heads, group, head_dim = shape
        block_size = 16
        context_lens = [150, 233]
        kv_layer, generator = random_pool(64, block_size, dtype, seed=group * 10 + head_dim, kv_heads=kv_heads,
                                          head_dim=head_dim)
        tables = shuffled_tables(context_lens, block_size, 64, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=generator).to(dtype)

        out = decode_attention_triton(q, kv_layer, tables, lens, head_dim**-0.5)

        expected = decode_attention_torch(q, kv_layer, tables, lens, head_dim**-0.5)
        torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    @pytest.mark.parametrize("window", [1, 7, 16, 50, 1000])
    def test_decode_sliding_window_matches_torch(window):
        # Group 3 (padded rows), contexts inside one block, at a block edge, and over many.
        block_size, group = 8, 3
        context_lens = [5, 16, 17, 90]
        kv_layer, generator = random_pool(48, block_size, torch.float32, seed=window)
        tables = shuffled_tables(context_lens, block_size, 48, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), KV_HEADS * group, HEAD_DIM, generator=generator)

        out = decode_attention_triton(q, kv_layer, tables, lens, 0.3, sliding_window=window)

        expected = decode_attention_torch(q, kv_layer, tables, lens, 0.3, sliding_window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        if window < max(context_lens):
            full = decode_attention_torch(q, kv_layer, tables, lens, 0.3)
            assert not torch.allclose(out, full, atol=1e-3)

    def test_decode_strided_q_odd_head_dim_and_empty_context():
        # q sliced from a fused qkv projection (row stride != heads * dim); head_dim 24 pads to 32;
        # a context_len 0 entry (bucket padding) must come out as zeros, not NaN.
        kv_layer, generator = random_pool(8, 8, torch.float32, seed=7, kv_heads=2, head_dim=24)
        qkv = torch.randn(3, 8 + 2 + 2, 24, generator=generator)
        q = qkv[:, :8]
        context_lens = [0, 13, 20]
        tables = shuffled_tables([1, 13, 20], 8, 8, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        out = decode_attention_triton(q, kv_layer, tables, lens, 0.2)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        expected = decode_attention_torch(q[1:], kv_layer, tables[1:], lens[1:], 0.2)
        torch.testing.assert_close(out[1:], expected, atol=1e-5, rtol=1e-5)

    # (num_splits, window, max_tile, dtype): splits that divide the blocks unevenly, more
    # splits than a short sequence has blocks (empty partials), a window that leaves leading
    # splits empty, and tiles smaller than a block (several tiles a block, some wholly masked).
    SPLIT_CASES = [(2, None, None, torch.float32), (3, None, 4, torch.bfloat16), (8, 20, 2, torch.float32),
                   (16, 9, None, torch.bfloat16)]

    @pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"s{c[0]}-w{c[1]}-t{c[2]}-{c[3]}")
    def test_split_decode_matches_torch(case, monkeypatch):
        num_splits, window, max_tile, dtype = case
        if max_tile is not None:
            monkeypatch.setattr(triton_kernels, "MAX_TILE", max_tile)
        block_size, group = 8, 3
        context_lens = [0, 3, 8, 45]  # a padded entry, inside one block, a block edge, several blocks
        kv_layer, generator = random_pool(16, block_size, dtype, seed=num_splits)
        tables = shuffled_tables([max(1, n) for n in context_lens], block_size, 16, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), KV_HEADS * group, HEAD_DIM, generator=generator).to(dtype)

        out = decode_attention_triton(q, kv_layer, tables, lens, 0.3, sliding_window=window, num_splits=num_splits)

        assert torch.equal(out[0], torch.zeros_like(out[0]))
        expected = decode_attention_torch(q[1:], kv_layer, tables[1:], lens[1:], 0.3, sliding_window=window)
        torch.testing.assert_close(out[1:].float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        whole = decode_attention_triton(q, kv_layer, tables, lens, 0.3, sliding_window=window, num_splits=1)
        torch.testing.assert_close(out.float(), whole.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    def test_num_splits_fill_idle_sms_and_depend_on_shapes_only():
        choose = triton_kernels.choose_num_splits
        # Llama-3-8B (8 kv heads) on 132 SMs: one sequence takes 8 programs, so split 16 ways.
        assert choose(1, 8, 256, 132) == 16
        assert choose(4, 8, 256, 132) == 4
        assert choose(16, 8, 256, 132) == 1  # 128 programs already fill the GPU
        assert choose(1, 1, 4, 132) == 4  # never more splits than table columns
        assert choose(1, 1, 4096, 132) == triton_kernels.MAX_SPLITS
        assert choose(0, 8, 256, 132) == 1
        assert choose(1, 8, 256, 1) == 1  # the CPU (interpreter) reports one SM
        with pytest.raises(ValueError, match="num_splits must be at least 1"):
            decode_attention_triton(torch.zeros(1, 2, HEAD_DIM), torch.zeros(2, 1, 8, 2, HEAD_DIM),
                                    torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
                                    num_splits=0)

    @pytest.mark.parametrize("dtype,window", [(d, None) for d in DTYPES] + [(torch.float32, 5)], ids=str)
    def test_paged_attention_triton_backend_matches_torch_backend(dtype, window):
        # Mixed step: 2 decode sequences, then a fresh prefill and one after a cached prefix.
        block_size, group = 8, 2
        seqs = [(11, 1), (17, 1), (6, 6), (20, 5)]  # (context_len, query_len)
        kv_layer, generator = random_pool(16, block_size, dtype, seed=3)
        tables = shuffled_tables([c for c, _ in seqs], block_size, 16, generator)
        slots = []
        for row, (context_len, query_len) in enumerate(seqs):
            for pos in range(context_len - query_len, context_len):
                slots.append(int(tables[row, pos // block_size]) * block_size + pos % block_size)
        num_tokens = sum(n for _, n in seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
            query_lens=tuple(n for _, n in seqs),
            context_lens_host=tuple(c for c, _ in seqs),
            num_decode_seqs=2,
            block_size=block_size,
        )
        q = torch.randn(num_tokens, KV_HEADS * group, HEAD_DIM, generator=generator).to(dtype)
        k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        pool_torch = kv_layer.clone()

        out = PagedAttention("triton")(q, k, v, kv_layer, meta, 0.25, sliding_window=window)

        expected = PagedAttention("torch")(q, k, v, pool_torch, meta, 0.25, sliding_window=window)
        assert torch.equal(kv_layer, pool_torch)
        torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    # ---- 8-bit pools (attention/kv_quant.py): against float32 on the dequantized values ----
    FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
    FP8_SCALES = (0.05, 0.02)

    def fp8_pool(num_blocks, block_size, dtype, seed, kv_heads=KV_HEADS, head_dim=HEAD_DIM, edge=False):
        """Random K/V stored divided by FP8_SCALES; edge: magnitudes up to 1.5x the type's largest."""
        from model_service.attention.kv_quant import quantize

        generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        limit = torch.finfo(dtype).max
        pool = torch.empty(2, *shape, dtype=dtype)
        for index, scale in enumerate(FP8_SCALES):
            values = torch.randn(shape, generator=generator) * scale
            if edge:
                values = torch.rand(shape, generator=generator) * 1.5 * limit * scale * torch.sign(values)
            pool[index] = quantize(values, scale, dtype)
        return pool, generator

    def fp8_reference(q, pool, tables, lens, scale):
        from model_service.attention.kv_quant import dequantize

        pool32 = torch.stack([dequantize(pool[i], FP8_SCALES[i], torch.float32) for i in range(2)])
        return decode_attention_torch(q.float(), pool32, tables, lens, scale)

    @pytest.mark.parametrize("dtype", FP8, ids=str)
    def test_fp8_write_matches_torch_and_saturates(dtype):
        pool_triton = torch.zeros(2, 10, 8, KV_HEADS, HEAD_DIM, dtype=dtype)
        pool_torch = pool_triton.clone()
        generator = torch.Generator().manual_seed(5)
        k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        k[0] = 1e30  # far past the largest fp8 value once divided by the scale: saturates
        slots = torch.tensor([3, 17, 40, 79, -1])
        write_kv_triton(k, v, pool_triton, slots, kv_scales=FP8_SCALES)
        write_kv_torch(k[:4], v[:4], pool_torch, slots[:4], kv_scales=FP8_SCALES)
        assert torch.equal(pool_triton.view(torch.uint8), pool_torch.view(torch.uint8))
        assert torch.isfinite(pool_triton.float()).all()
        assert pool_triton[0].view(-1, KV_HEADS, HEAD_DIM)[3].float().eq(torch.finfo(dtype).max).all()

    @pytest.mark.parametrize("dtype", FP8, ids=str)
    @pytest.mark.parametrize("group", [1, 2, 4])
    def test_fp8_decode_matches_float32_on_dequantized_values(group, dtype):
        block_size = 16
        context_lens = [1, block_size, block_size + 1, 3 * block_size - 2]
        pool, generator = fp8_pool(16, block_size, dtype, seed=group)
        tables = shuffled_tables(context_lens, block_size, 16, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), KV_HEADS * group, HEAD_DIM, generator=generator).to(torch.bfloat16)
        # group 2 through the split kernel and its reduce (v_scale on the partials)
        out = decode_attention_triton(q, pool, tables, lens, HEAD_DIM**-0.5, kv_scales=FP8_SCALES,
                                      num_splits=2 if group == 2 else 1)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), fp8_reference(q, pool, tables, lens, HEAD_DIM**-0.5),
                                   atol=2e-2, rtol=2e-2)

    @pytest.mark.parametrize("shape", SERVED_SHAPES, ids=lambda s: f"kv{s[0]}-g{s[1]}-d{s[2]}")
    def test_fp8_decode_served_gqa_groups_at_the_saturation_edge(shape):
        kv_heads, group, head_dim = shape
        dtype = FP8[(group + head_dim) % 2]  # both types over the shapes, not every pair
        context_lens = [40, 90]
        pool, generator = fp8_pool(32, 16, dtype, seed=group * 10 + head_dim, kv_heads=kv_heads,
                                   head_dim=head_dim, edge=True)
        assert pool.float().abs().eq(torch.finfo(dtype).max).any()
        tables = shuffled_tables(context_lens, 16, 32, generator)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=generator)
        q /= torch.finfo(dtype).max * FP8_SCALES[0] * head_dim**0.5  # scores a softmax can tell apart
        out = decode_attention_triton(q, pool, tables, lens, head_dim**-0.5, kv_scales=FP8_SCALES)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, fp8_reference(q, pool, tables, lens, head_dim**-0.5), atol=1e-3, rtol=2e-5)
