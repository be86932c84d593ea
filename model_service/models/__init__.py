"""Llama-family models over the paged KV pool: config, weights, the tiny model, loading."""

from model_service.models.config import ModelConfig, ModelLoadError
from model_service.models.llama import LlamaForCausalLM, last_token_indices
from model_service.models.loader import LoadedModel, load_model

__all__ = ["LlamaForCausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "last_token_indices", "load_model"]
