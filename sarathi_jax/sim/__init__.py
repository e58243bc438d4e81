"""The discrete-event simulator: the engine core and the real schedulers on a virtual clock, with a cost model in
place of a model (`simulator`), cost models calibrated on the real runner (`cost_model`) and scaled to tensor
parallel instances (`tp_cost`)."""
