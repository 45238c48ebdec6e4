"""The training loop: `Trainer` and its callbacks, strategies by name, the run of a whole job (`run`,
`launcher`), its summary files (`report`) and `ddpkit bench` (`bench`)."""
