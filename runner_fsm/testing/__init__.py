"""In-process fakes and scripted scenarios for tests and benchmarks (not used in production)."""
