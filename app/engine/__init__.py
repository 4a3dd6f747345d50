"""The engine layer: the one thread that calls the model, its scheduler, batching policy, pacing and errors."""
