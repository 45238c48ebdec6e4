"""Compatibility surfaces for code written against other libraries' import paths (opt-in: nothing here is
installed by ``import ddpkit``). `ddpkit.compat.fairscale` makes ``from fairscale.optim import OSS`` and the like
resolve to ddpkit."""
