"""ggufc: an ahead-of-time compiler for GGUF models."""

__version__ = "0.1.0"
