"""Shared vocabulary of every layer: settings, the error table, the wire codec, the metrics registry, waiting
on work that cannot be taken back."""
