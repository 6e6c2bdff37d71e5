"""Benchmarks a reader can rerun: the training step (engine/step.py) timed, the ladder, peers, loaders, optimizers."""
