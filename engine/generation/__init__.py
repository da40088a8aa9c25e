"""Making text: sampling, the plain and the CUDA-graph decode loops, rollouts, K LoRA
candidates decoded in one batch (multilora.py), chat."""
