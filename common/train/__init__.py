"""The run and the parts it owns: run directory, checkpoints, evaluation, guards, stopping, summary, tracking."""
