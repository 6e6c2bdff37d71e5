"""Benchmarks users can rerun: `vitrain bench <what>`."""
