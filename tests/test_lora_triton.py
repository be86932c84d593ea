"""LoRA's Triton segmented product (model_service/models/lora_triton.py) against float64
(harness/lora_segments.py): under Triton's interpreter on CPU at small shapes, and on CUDA
(skipped without it) at a model's shapes through LoraStep, as the model calls it.

Under the interpreter: ranks 1 to 64 and past one rank block (80), powers of two and not;
float32, bfloat16 and float16; runs of one row, long runs (the 64-row blocks), empty runs,
rows of the base between them, an adapter without the projection, many adapters at once,
in_features split between programs; x strided and the output a column slice of a wider
one. Rows and columns outside the runs must come back bit for bit.
"""

from __future__ import annotations

import pytest

from triton_interpreter import IN_INTERPRETER, run_file

# (name, segments as (rows, rank; None: base rows; 0: an adapter without the projection),
# in_features, out_features, num_splits)
CASES = [
    ("mixed", [(2, 1), (1, None), (3, 7), (0, 16), (2, 33), (1, 0), (2, 64), (1, None)], 40, 70, None),
    ("one-row", [(1, 5)], 24, 18, None),
    ("many-adapters-split-k", [(1, rank) for rank in (1, 2, 3, 8, 13, 16, 31, 64, 4, 9)] + [(2, None)], 130, 20, 3),
    ("long-run-rank-80", [(20, 80), (1, None), (1, 17)], 24, 66, None),
]

if not IN_INTERPRETER:
    import torch

    from harness import lora_segments

    @pytest.mark.timeout(600)
    def test_lora_triton_under_interpreter():
        run_file(__file__, timeout=500)

    def test_a_loaded_adapters_table_is_kept_for_its_life():
        import torch

        from model_service.lora.peft_adapter import LoraAdapter, LoraWeights
        from model_service.models import lora_tables

        factors = LoraWeights(a=torch.zeros(4, 16), b=torch.zeros(8, 4))
        adapter = LoraAdapter(name="a", path="p", rank=4, scaling=2.0, digest="d", weights={(1, "o_proj"): factors})
        table = lora_tables.adapter_table(adapter, torch.device("cpu"))
        assert table.factors[1, lora_tables.TARGET_INDEX["o_proj"]].tolist() == [factors.a.data_ptr(),
                                                                                 factors.b.data_ptr(), 4]
        assert lora_tables.adapter_table(adapter, torch.device("cpu")) is table  # kept, not built again

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernels")

    @needs_cuda
    @pytest.mark.parametrize("shape", lora_segments.DEVICE_SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
    @pytest.mark.parametrize("segments", [lora_segments.DECODE_SEGMENTS, lora_segments.PREFILL_SEGMENTS],
                             ids=["decode", "prefill"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    def test_on_cuda_through_lora_step(dtype, segments, shape):
        margin, untouched, triton = lora_segments.through_lora_step(segments, *shape, dtype, "cuda", seed=len(segments))
        assert triton, "torch's matmuls served, not the Triton kernels"
        assert margin <= 1.0
        assert untouched

else:
    import gc

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from harness import lora_segments
    from model_service.models import lora_tables, lora_triton

    assert isinstance(lora_triton._shrink_kernel, InterpretedFunction), "kernels imported before TRITON_INTERPRET=1"

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    @pytest.mark.parametrize("case", CASES, ids=lambda case: case[0])
    def test_segments_match_float64(case, dtype):
        _, segments, in_features, out_features, num_splits = case
        batch = lora_segments.random_batch(segments, in_features, out_features, dtype, seed=len(segments))
        tables = lora_tables.StepTables.of_runs(batch.runs, torch.device("cpu"))
        got = batch.out.clone()
        assert tables.supports(got, batch.x)
        lora_triton.add(tables, got, batch.x, *lora_segments.KEY, column=batch.column, num_splits=num_splits)
        assert lora_segments.margin(got, batch) <= 1.0
        untouched = ~batch.covered()
        assert torch.equal(got[untouched], batch.out[untouched])
        columns = slice(batch.column, batch.column + out_features)
        assert torch.equal(got[:, :columns.start], batch.out[:, :columns.start])
        assert torch.equal(got[:, columns.stop:], batch.out[:, columns.stop:])
        assert not torch.equal(got, batch.out)

    def test_the_bound_catches_a_wrong_scaling():
        # The check above can fail: a run's delta at 1.01 of its scaling is off the bound.
        batch = lora_segments.random_batch([(2, 8), (1, 3)], 40, 30, torch.float32)
        tables = lora_tables.StepTables.of_runs(batch.runs, torch.device("cpu"))
        got = batch.out.clone()
        lora_triton.add(tables, got, batch.x, *lora_segments.KEY, column=batch.column)
        assert lora_segments.margin(got, batch) <= 1.0
        batch.runs[1].adapter.scaling *= 1.01
        assert lora_segments.margin(got, batch) > 1.0

    def test_factors_the_kernels_cannot_read_leave_the_step_to_torch():
        def runs(change=None):
            batch = lora_segments.random_batch([(2, 8), (1, 3)], 40, 30, torch.float32)
            if change is not None:
                factors = batch.runs[1].adapter.weights[lora_segments.KEY]
                factors.b = change(factors.b)
            return batch.runs

        cpu = torch.device("cpu")
        assert lora_tables.StepTables.of_runs(runs(), cpu) is not None
        assert lora_tables.StepTables.of_runs(runs(), torch.device("meta")) is None  # another device
        assert lora_tables.StepTables.of_runs(runs(lambda b: b.half()), cpu) is None  # dtypes differ
        assert lora_tables.StepTables.of_runs(runs(lambda b: b.t().contiguous().t()), cpu) is None  # strided
        assert lora_tables.StepTables.of_runs(runs(), cpu).supports(torch.zeros(3, 30), torch.zeros(3, 40))
        assert not lora_tables.StepTables.of_runs(runs(), cpu).supports(torch.zeros(3, 30).half(), torch.zeros(3, 40))

    def test_an_adapters_table_is_kept_while_it_lives_and_dropped_with_it():
        batch = lora_segments.random_batch([(2, 8), (1, 3)], 40, 30, torch.float32)
        adapter = batch.runs[0].adapter
        key = (id(adapter), torch.device("cpu"))
        first = lora_tables.StepTables.of_runs(batch.runs, torch.device("cpu"))
        table = lora_tables._TABLES[key]
        assert lora_tables.adapter_table(adapter, torch.device("cpu")) is table  # not built again
        second = lora_tables.StepTables.of_runs(batch.runs, torch.device("cpu"))
        assert torch.equal(first.factors, second.factors)
        del batch, adapter, first, second
        gc.collect()
        assert key not in lora_tables._TABLES
