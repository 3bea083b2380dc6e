"""Benchmarks that ship with the package: the serving load generator (`tokenhaul bench serve`)."""
