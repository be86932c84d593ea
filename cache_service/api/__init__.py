"""The cache service's front doors: the gRPC servicer and its proto mappings, the process, /metrics, the sizing CLI."""
