"""Layer 0, core: errors, atomic file writes, test-only faults, dtypes, the batch constants, where shipped files are, what this machine computes natively, which hosts are loopback.

Rule: imports nothing from `training`.
"""
