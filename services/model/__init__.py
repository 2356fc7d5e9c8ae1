"""A model on disk as every part that serves it reads it, torch-free: where it lives
(store.py), its GGUF metadata (gguf_file.py), tokenizer and chat template, its text
architecture (arch.py, hf_config.py) and a LLaVA model's vision settings and image
placeholders (llava_config.py, image_spans.py). The engine loads weights on top of this;
the processor tokenizes and expands image placeholders with it."""
