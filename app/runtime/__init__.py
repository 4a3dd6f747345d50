"""The runtime layer: what one app holds and how it starts, warms up and stops (``Services``)."""
