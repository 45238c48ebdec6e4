"""What several benchmarks share: workloads, result files, network-namespace hosts, memory figures, plot style.

Timing (steps after a warm-up, medians, interleaved rounds, ratios) lives in the library, `ddpkit.measure.timing`,
so that ``ddpkit bench`` and these benchmarks measure alike.
"""
