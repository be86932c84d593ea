"""LoRA adapters over the base model: read from PEFT's format (peft_adapter.py) and held,
all or none, in a fixed number of slots (registry.py)."""
