"""Benchmarks: every claim of speed measured against its baseline in the same run."""
