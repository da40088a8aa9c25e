"""The base model and its adapter: loading (4-bit, GGUF, cache), LoRA, kernels patched into the
blocks, activation offload, start-up, writing and exporting adapters."""
