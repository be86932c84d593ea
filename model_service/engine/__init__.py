"""The engine loop: one thread that admits requests, runs each step (schedule, execute, sample, update) and streams what it made."""
