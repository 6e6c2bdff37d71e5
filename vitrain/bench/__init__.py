"""Benchmarks a reader can rerun (`vitrain bench loader|optim`) and cost models (memory per device)."""
