"""Registered ways to replay a captured graph: eager, graph, native, compile, cuda_graphs."""

from __future__ import annotations

from .registry import Backend, BackendUnsupported, backend_names, get_backend, register_backend

__all__ = ["Backend", "BackendUnsupported", "backend_names", "get_backend", "register_backend"]
