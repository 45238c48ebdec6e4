"""ddpkit's benchmarks: ``python -m benchmarks`` lists them, ``python -m benchmarks NAME`` runs one."""
