"""The pieces of ``rp-train`` (rp_engine/cli.py): models and presets, data loading and packing,
the run folder, the W&B/tqdm tracker and the memory preflight / plan preview."""
