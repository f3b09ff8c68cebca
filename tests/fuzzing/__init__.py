"""Deterministic hostile-input generators and the runner behind tests/fuzzing/test_fuzz.py and bench/fuzz.py."""
