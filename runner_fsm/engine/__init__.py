"""The embedded engine: scheduler and multi-process launcher."""
