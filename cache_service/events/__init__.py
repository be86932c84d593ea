"""vLLM-format KV events: what the prefix cache gains and loses, told to prefix-aware routers over ZMQ."""
