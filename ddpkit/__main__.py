"""`python -m ddpkit ...` (and `torchrun -m ddpkit train ...`) run the `ddpkit` command."""

from ddpkit.cli import main

if __name__ == "__main__":
    main()
