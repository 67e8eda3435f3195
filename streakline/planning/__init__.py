"""Planning: memory per GPU, disk and time of every stage on a named cluster, before anything is queued."""
