"""The step path: saved-tensor hooks (pack/unpack), the step (stats, dedup,
events), placement (which tier a tensor goes to), prefetching, copy jobs,
staging leases and the tail hold. Nothing here is public API."""
