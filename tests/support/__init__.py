"""Helpers and fixture writers shared by the tests and benchmarks."""
