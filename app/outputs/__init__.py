"""The outputs layer: what committed units become (stages, encoders) and how they reach clients (delivery, replay)."""
