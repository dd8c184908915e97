"""A name the engine has and a compatibility layer lacks is an AttributeError that says so and what to do, not
Python's bare "has no attribute"; ``hasattr`` still answers False, and the import system's probes get the plain
answer. Where the engine is installed, the name really is one of its own."""

from __future__ import annotations

import importlib

import pytest

LAYERS = [("unidist.compat.deepspeed", "deepspeed", "init_inference", "docs/coming-from/deepspeed.md"),
          ("unidist.compat.horovod", "horovod.torch", "mpi_lib_v2", "docs/coming-from/horovod.md")]


@pytest.mark.parametrize(("layer", "engine", "name", "page"), LAYERS)
def test_a_name_the_layer_lacks_says_so(layer: str, engine: str, name: str, page: str) -> None:
    mod = importlib.import_module(layer)
    assert not hasattr(mod, name)
    with pytest.raises(AttributeError, match=rf"{name} is not in unidist's compatibility layer \({layer}\).*"
                                             rf"{page}.*itself"):
        getattr(mod, name)
    with pytest.raises(AttributeError, match=r"^module .* has no attribute '__wrapped__'$"):
        mod.__wrapped__  # noqa: B018 - what inspect and the import system probe
    try:
        real = importlib.import_module(engine)
    except Exception:  # the engine is not installed in this environment (or fails to import): the layer's part holds
        return
    assert hasattr(real, name), f"{engine} has no {name}: pick a name it has for this test"
