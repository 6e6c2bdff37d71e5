"""Benchmarks and cost models: memory per device under each parallel strategy."""
