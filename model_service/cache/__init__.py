"""The model service's session with the cache service: the gRPC client, Attach, heartbeats, lease calls in flight, detach."""
