"""Benchmarks a reader can rerun from the command line (`vitrain bench ...`)."""
