"""Asynchronous parameter-server training, pure torch: a flat layout of the parameters sharded over server ranks
(:mod:`.layout`), the server that applies pushes and answers pulls under a staleness bound (:mod:`.server`),
the worker's client (:mod:`.client`) and the wire between them (:mod:`.protocol`)."""

from lightning_parallel.parallel.async_ps.client import ServerClient
from lightning_parallel.parallel.async_ps.layout import FlatLayout, check_optimizer
from lightning_parallel.parallel.async_ps.protocol import check_settings, check_world, is_server
from lightning_parallel.parallel.async_ps.server import Clip, ParameterServer

__all__ = [
    "Clip",
    "FlatLayout",
    "ParameterServer",
    "ServerClient",
    "check_optimizer",
    "check_settings",
    "check_world",
    "is_server",
]
