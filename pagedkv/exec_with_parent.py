"""`python -m pagedkv.exec_with_parent PROGRAM [ARGS...]`: runs a program that cannot call
libc.die_with_launcher() itself (a store server's binary) so that it dies with the process
that launched this one. The death signal is armed here and survives the exec."""

from __future__ import annotations

import os
import sys

from pagedkv import libc

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m pagedkv.exec_with_parent PROGRAM [ARGS...]")
    libc.die_with_launcher()
    os.execvp(sys.argv[1], sys.argv[1:])
