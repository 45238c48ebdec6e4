"""A training job's configuration: its flags, TOML files and checks (`config`), and what every rank of a job
must share, compared before training starts (`agreement`)."""
