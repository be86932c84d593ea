"""The device worker: the model runner and decode graphs, the only code that touches the device, and its thread pool."""
