"""The pieces of ``rp-train`` (train/cli.py, the run): its arguments (args.py), the embedded
default job (default_job.py), models and presets, data loading and packing, the run folder, the
W&B/tqdm tracker and the memory preflight / plan preview."""
