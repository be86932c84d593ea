"""The block pool and its prefix hashes: blocks, reference counts and the prefix index, knowing no lease."""
