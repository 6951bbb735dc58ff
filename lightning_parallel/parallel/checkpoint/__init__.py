"""Checkpoint formats. Pure torch.

Owns: folders on disk (:mod:`.files`: atomic saves, manifests, loads that run no code), layout-independent
sharded state for torch's distributed checkpoint (:mod:`.sharded`, with :mod:`.chunks` for ZeRO's flat ranges),
gathered single-process state (:mod:`.full`) and pipelined optimizer state in that format (:mod:`.pipeline`).
May import: torch, ``parallel.data.flat_zero`` (flat ranges), ``parallel.pipeline.split`` (names across stages).
Never Lightning.
"""
