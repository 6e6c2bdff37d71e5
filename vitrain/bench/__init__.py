"""Benchmarks a reader can rerun (`vitrain bench ...`) and cost models (memory per device per strategy)."""
