"""How the suite's pytest-xdist run (`make test`: --dist loadfile) splits into work units
(tests/conftest.py): one a test file, except one for every module that uses the SmolLM2
session fixtures, so that one worker pays for that stack and reference, not each."""

from __future__ import annotations

import conftest


def test_the_smollm2_modules_are_one_unit_and_the_others_one_a_file():
    modules = conftest._smollm2_modules()
    assert {"test_smollm2_generate.py", "test_smollm2_tiers.py", "test_lora_smollm2.py"} <= modules
    # Not a module that only has the name inside a longer one (test_smollm2_stack_matches_...).
    assert "test_decode_stack.py" not in modules and "test_gguf.py" not in modules
    units = {conftest.work_unit(f"tests/{name}::test_x[a-b]", modules) for name in modules}
    assert units == {conftest.SMOLLM2_UNIT}
    assert conftest.work_unit("tests/test_gguf.py::test_x", modules) == "tests/test_gguf.py"
    assert conftest.work_unit("tests/test_gguf.py::Class::test_x", modules) == "tests/test_gguf.py"
