"""The Table-7 benchmark (``dlperf bench``); :func:`run` is its Python entry point, for notebooks.

Imported lazily, so that the command line starts without loading torch for other verbs.
"""

__all__ = ["run", "BenchConfig", "BenchResult"]


def __getattr__(name: str):
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
