"""Helpers for tests, benchmarks and sample recording: real SDK clients driving tool-using sessions."""
