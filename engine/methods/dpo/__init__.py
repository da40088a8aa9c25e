"""DPO: preference tuning on chosen / rejected pairs (DPO, IPO, SimPO, ORPO). `dpo.py`: the
loop, then the losses of a pair, the step's backward and the held-out evaluation."""
