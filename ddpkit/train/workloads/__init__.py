"""What a job trains: the registry of built-in models, datasets and losses by name (`registry`), their builders
and the check that a model fits its data (`workload`), the user's own factories (`factories`), the offline
datasets (`data`, `text`), the models (`models`, `gpt`) and the resumable sampler (`sampler`)."""
