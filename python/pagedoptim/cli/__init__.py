"""`python -m pagedoptim demo|plan|bench|convert` and their helpers (plots, machine probes,
timing, the memory planner). The top layer: it imports the library, nothing in the library
imports it (benchmarks/ and examples/ borrow its timing and data helpers)."""
