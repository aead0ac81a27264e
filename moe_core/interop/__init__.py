"""Interoperability with other frameworks' checkpoints: Hugging Face transformers (``moe_core.interop.hf``)."""
