"""`cs336-bench`: one CLI with suites, a tidy result store and shared profiling paths."""
