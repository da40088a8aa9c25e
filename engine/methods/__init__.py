"""One folder per training method, each with its loop at the top of the file named after it
(`sft/sft.py`, `fgrpo/fgrpo.py`, `essa/essa.py`, `dpo/dpo.py`) and the parts no other method
uses beside it; what two or more methods share is in engine/training/."""
