"""csrc/cpu_levels.h, the one scheme by which every kernel family picks its level: the best
level is the highest whose CPU check passes, and a level picks its row of a table, clamped
to the table (compiled and run as a small C program)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from model_service.cpu_kernels import build

COMPILER = shutil.which("cc") or shutil.which("gcc")

PROGRAM = r"""
#include <stdio.h>
#include "cpu_levels.h"

static int yes(void) { return 1; }
static int no(void) { return 0; }

int main(void) {
    static const cpu_check_fn gap[] = {0, yes, no, yes};   /* a level above a failed one */
    static const cpu_check_fn none[] = {0, no, no};
    static const cpu_check_fn portable[] = {0};
    static const cpu_check_fn missing[] = {0, 0, yes};     /* an entry a build lacks */
    static const int table[] = {10, 11, 12};
    printf("%d %d %d %d\n", best_level(gap), best_level(none), best_level(portable), best_level(missing));
    printf("%d %d %d %d\n", LEVEL_PICK(table, -1), LEVEL_PICK(table, 0), LEVEL_PICK(table, 2), LEVEL_PICK(table, 9));
    return 0;
}
"""


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
def test_best_level_and_level_pick(tmp_path):
    (tmp_path / "levels.c").write_text(PROGRAM)
    binary = tmp_path / "levels"
    compiled = subprocess.run([COMPILER, "-std=gnu11", "-Wall", "-Werror", f"-I{build.CSRC}", "-o", str(binary),
                               str(tmp_path / "levels.c")], capture_output=True, text=True, timeout=60)
    assert compiled.returncode == 0, compiled.stderr
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=10, check=True)
    assert result.stdout.split("\n")[:2] == ["3 0 0 2", "10 10 12 12"]
