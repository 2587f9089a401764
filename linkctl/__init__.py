"""linkctl: verified, measured direct links for llama.cpp RPC split inference."""

__version__ = "0.1.0"
