"""One module per `cs336-bench` suite, each with `add_arguments(parser)` and `run(args) -> exit code`."""
