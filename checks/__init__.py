"""Checks that pass or fail but are too long or need hardware the test suite has not: the GPU
check (gpu_check.py) and the soaks (soak.py; memory_soak.py and abuse_soak.py are its modes)."""
