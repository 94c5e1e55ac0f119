"""What ran in the forward: producer recording and recipes for recompute,
the running module hierarchy, and checks on parameters written in place.
Nothing here is public API."""
