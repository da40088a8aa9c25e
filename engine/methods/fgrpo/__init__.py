"""F-GRPO: group-relative RL with verifiable rewards and focal group weights. `fgrpo.py`: the
loop, then its step (generate_trajectory, policy_update); `loss.py`: the advantages, focal
weights and policy losses; `evaluate.py`: the held-out evaluation; `passk.py`: pass@k."""
