"""The sessions layer: session operations, the handle and registry, the store, parking, limits, peers."""
