"""Checkpoints: saving and loading a job's state, collectively (`checkpoint`), the folders, commit markers and
checksums on disk (`checkpoint_files`), and one job per output folder (`out_lock`)."""
