"""Deterministic hostile-input generators and the runner behind tests/test_fuzz.py and bench/fuzz.py."""
