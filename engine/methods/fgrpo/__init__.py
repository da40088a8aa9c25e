"""F-GRPO: group-relative RL with verifiable rewards and focal group weights. `fgrpo.py`: the
loop, then its step (generate_trajectory, policy_update); `loss.py`: the advantages, focal
weights and policy losses. Its held-out evaluation is the shared grading (engine/training/grading.py)."""
