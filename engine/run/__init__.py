"""A run from the outside: the API the app and the CLI call, the worker process that trains,
the checks before a start, the evaluation that compares the base and adapters."""
