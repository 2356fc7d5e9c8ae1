"""Torch building blocks of the Llama-family model: linear (TP-ready), norm, rotary, attention."""
