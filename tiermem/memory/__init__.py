"""Where bytes live and how much there is: the pinned host pool, the NVMe
file arena, private spill directories, malloc and cgroup facts, and each
rank's share of a node. Nothing here is public API."""
