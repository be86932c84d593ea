"""Settings the whole test process needs before anything imports grpc."""

import os

# The tests start service processes with a preexec_fn (PR_SET_PDEATHSIG), so Popen
# really forks; with gRPC's fork support on, its pre-fork handler waits for gRPC's own
# threads to quiesce, and a test hung there for minutes (seen in test_multi_tenant, the
# parent stuck in fork() inside cygrpc's atfork handler). The child only sets its death
# signal and execs, so it needs none of that support.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
