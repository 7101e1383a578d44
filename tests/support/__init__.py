"""What several tests share, a module per concern (a service as a process, faults, clusters, events)."""
