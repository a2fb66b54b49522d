"""Models from local Hugging Face style directories: config, safetensors weights, tokenizer, chat template."""
from .config import ModelConfig, ModelLoadError, parse_dtype
from .llama import CausalLM, load_model
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["ModelConfig", "ModelLoadError", "parse_dtype", "CausalLM", "load_model", "Tokenizer",
           "load_tokenizer"]
