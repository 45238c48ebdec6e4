"""Measuring and advising, shared by `ddpkit bench` and `benchmarks/` without importing the trainer: timed steps
and ratios (`timing`), the link model and strategy recommendation (`advisor`), the figures (`plots`)."""
