"""The pipeline engine (no Lightning imports): schedules, partitioning, transport and the runtime."""
