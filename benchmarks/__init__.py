"""Benchmarks that print tables and write JSON under benchmarks/results/ (not timed tests): `make bench`."""
