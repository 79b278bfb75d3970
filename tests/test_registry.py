"""dlperf.registry.Registry: the one table of named choices, and the registries built on it."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from dlperf.errors import UsageError
from dlperf.registry import Registry


def test_a_second_registration_of_a_name_raises_and_keeps_the_first():
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice.*replace=True"):
        reg.register("a", 2)
    assert reg.get("a") == 1


def test_replace_true_overwrites_in_place():
    reg: Registry[int] = Registry("widget")
    reg.register("a", 1)
    reg.register("b", 2)
    reg.register("a", 3, replace=True)
    assert reg.get("a") == 3
    assert reg.names() == ["a", "b"]  # the replaced name keeps its place


def test_a_miss_is_one_line_listing_what_exists():
    reg: Registry[int] = Registry("widget", extra_choices=("auto",))
    for i, name in enumerate(["x", "y"]):
        reg.register(name, i)
    with pytest.raises(UsageError) as err:
        reg.get("z")
    assert str(err.value) == "unknown widget 'z'; valid choices: auto, x, y"
    with pytest.raises(UsageError, match="unknown widget \\['x'\\]"):
        reg.get(["x"])  # unhashable: still a plain miss, not a TypeError


def test_names_contains_iteration_and_reserved_names():
    reg: Registry[int] = Registry("widget", normalize=str.lower, extra_choices=("auto",))
    reg.register("b", 1)
    reg.register("a", 2)
    assert reg.names() == ["b", "a"] and list(reg) == ["b", "a"] and len(reg) == 2
    assert "a" in reg and "A" in reg and "c" not in reg and "auto" not in reg and [1] not in reg
    assert reg.get("B") == 1
    with pytest.raises(ValueError, match="reserved"):
        reg.register("auto", 3)
    reg.remove("a")
    reg.remove("never-there")
    assert reg.names() == ["b"]


@pytest.fixture
def lazy_module(tmp_path, monkeypatch):
    """A module on sys.path that counts how often it is imported."""
    (tmp_path / "dlperf_lazy_probe.py").write_text(textwrap.dedent("""
        import builtins
        builtins.dlperf_lazy_imports = getattr(builtins, "dlperf_lazy_imports", 0) + 1
        def make():
            return "made"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "dlperf_lazy_probe"
    sys.modules.pop("dlperf_lazy_probe", None)
    import builtins
    if hasattr(builtins, "dlperf_lazy_imports"):
        del builtins.dlperf_lazy_imports


def test_a_lazy_entry_is_imported_on_first_get_and_only_once(lazy_module):
    import builtins

    reg: Registry = Registry("mode")
    reg.register("lazy", f"{lazy_module}:make")
    assert lazy_module not in sys.modules  # registering imports nothing
    assert "lazy" in reg and reg.names() == ["lazy"]
    fns = []
    threads = [threading.Thread(target=lambda: fns.append(reg.get("lazy"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert [f() for f in fns] == ["made"] * 4
    assert len({id(f) for f in fns}) == 1
    assert builtins.dlperf_lazy_imports == 1
    assert reg.get("lazy") is fns[0] and builtins.dlperf_lazy_imports == 1


@pytest.mark.parametrize("bad", ["no_colon", "mod:", ":attr", "mod:attr.sub", "a b:c"])
def test_a_malformed_lazy_entry_is_refused_at_registration(bad):
    with pytest.raises(ValueError, match="package.module:attribute"):
        Registry("mode").register("x", bad)


def test_a_lazy_entry_whose_module_is_missing_fails_on_get_and_can_be_retried():
    reg: Registry = Registry("mode")
    reg.register("gone", "dlperf_no_such_module_here:f")
    with pytest.raises(ModuleNotFoundError):
        reg.get("gone")
    assert "gone" in reg  # still registered: a fixed environment can resolve it later


# --- the registries built on it keep their public functions --------------------------------------

def test_models_registry_is_case_insensitive_and_refuses_duplicates():
    from dlperf.models import get_spec, model_names, register

    assert get_spec("LeNet") is get_spec("lenet")
    assert model_names(paper_only=True) == ["fcn-s", "alexnet-s", "resnet-50", "fcn-r", "alexnet-r",
                                            "resnet-56", "lstm"]
    with pytest.raises(ValueError, match="registered twice"):
        register(get_spec("lenet"))
    with pytest.raises(UsageError, match="unknown network 'nope'; valid choices: fcn-s, .*, mlp$"):
        get_spec("nope")


def test_kvstore_registry_refuses_duplicates_and_lists_types():
    from dlperf.kvstore import KVStore, create_kvstore, kvstore_types, register_kvstore

    assert {"local", "device", "dist_sync", "dist_async", "dist_device_sync"} <= set(kvstore_types())
    with pytest.raises(ValueError, match="registered twice"):
        register_kvstore("local", type(create_kvstore("local")))
    with pytest.raises(UsageError, match=r"unknown kvstore type 'dist'; valid choices: .*\blocal\b"):
        KVStore("dist")
    with create_kvstore("LOCAL") as kv:
        assert kv.type == "local"


def test_backend_registry_reserves_auto():
    from dlperf.hybrid.backends import backend_names, get_backend, register_backend
    from dlperf.hybrid.backends.registry import Backend

    assert "graph" in backend_names()
    with pytest.raises(UsageError, match="unknown hybridize backend 'x'; valid choices: auto, .*graph"):
        get_backend("x")
    for name in ("auto", "graph"):
        with pytest.raises(ValueError):
            register_backend(Backend(name, lambda c, a: None, True, ("cpu",), False, "double"))
