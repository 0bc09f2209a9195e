"""A from-scratch Qwen3 / Qwen3-Next language model whose weights move to and from transformers."""

from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.model import QwenLM

__all__ = ["QwenConfig", "QwenLM"]
