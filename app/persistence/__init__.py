"""The persistence layer: session records in the snapshot folder and the leases that fence them."""
