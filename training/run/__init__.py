"""Layer 2, run: the run directory, metrics, trackers, the model card, and where models come from.

Rule: files only (what the app reads); imports only core and config.
"""
