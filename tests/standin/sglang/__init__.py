"""Stand-in ``sglang`` package for tests: put ``tests/standin`` on PYTHONPATH to use it."""
