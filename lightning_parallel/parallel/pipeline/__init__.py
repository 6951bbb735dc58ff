"""Pipeline parallelism on the ``pp`` axis (torch.distributed.pipelining underneath). Pure torch.

Owns: the schedule table (:mod:`.schedules`: torch class, stages per rank, placement, microbatches in flight,
bubble), cutting layers into stages (:mod:`.partition`, :mod:`.profile`), splitting a model in place
(:mod:`.split`), weights tied across stages (:mod:`.tied`) and running the stages (:mod:`.runner`).
May import: torch, :mod:`lightning_parallel.parallel.mesh`, ``parallel.tensor.plan`` (tie discovery) and
``parallel.measure`` (timeline hooks, activation bytes). Never Lightning.
"""
