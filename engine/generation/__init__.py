"""Making text: sampling, the plain and the CUDA-graph decode loops, rollouts, chat."""
