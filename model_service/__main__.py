import os
import sys

from pagedkv import libc

libc.die_with_launcher()  # first: a launcher killed from here on takes this process with it

# Before torch loads libgomp, which reads it once: how long an OpenMP worker spins between
# parallel regions before it sleeps on a futex. A forward pass's regions are separated by
# the engine thread's own work (Python glue, sampling, the next step's inputs) for longer
# than libgomp's default spin, so without this its workers sleep and are woken again many
# times a step; on a virtual machine each wake-up is an inter-processor interrupt. A
# setting of the user's own (GOMP_SPINCOUNT, or OMP_WAIT_POLICY) is kept.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "3000000"

from model_service.server import main  # noqa: E402
from pagedkv.serving import exit_process  # noqa: E402

exit_process(main(sys.argv[1:]))
