"""Optimizers whose math needs more than an element at a time (Muon: each whole weight matrix), sharded here
rather than by the data-parallel shardings. Pure torch, no Lightning."""
