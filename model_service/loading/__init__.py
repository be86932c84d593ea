"""Where a model comes from: Hugging Face safetensors, GGUF files, the embedded SmolLM2, the tiny model; and its fingerprint."""
