"""Checkpoint formats. Pure torch.

Owns: folders on disk (:mod:`.files`: atomic saves, manifests, loads that run no code), layout-independent
sharded state for torch's distributed checkpoint (:mod:`.sharded`, with :mod:`.chunks` for ZeRO's flat ranges),
gathered single-process state (:mod:`.full`), pipelined optimizer state in that format (:mod:`.pipeline`), and
what a module trained in part leaves out of its checkpoints (:mod:`.selection`: a frozen base under adapters).
May import: torch, ``parallel.data.sharding`` (a sharding's state view: flat ranges), ``parallel.data.flat_group``
(``SCALAR_STATE_KEYS``), ``parallel.pipeline.split`` (names across stages).
Never Lightning.
"""
