"""The public API's shape: the top-level names, the lazy ``reference`` submodule, and every
deprecated name (each warns, names its replacement, and still works for one release)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest

import kvcache as kc
from kvcache import latent, mla, o1, rebind

TOP = {
    # caches
    "LayerKvCache", "KvCache", "StaticKvCache", "LatentKvCache", "LazyLatentCache",
    # modes, policies
    "KvMode", "EvictionPolicy", "O1Rect",
    # threads
    "threads", "thread_settings", "BlasGovernor",
    # errors
    "WireError", "RebindRefused",
    "show_config", "__version__",
}

MOVED = {
    "DecodePlan": rebind, "KvAllocId": rebind, "KvPlanSource": rebind,
    "KvRebindSource": rebind, "PlanValidity": rebind, "RebindRefusal": rebind,
    "mla_decode": mla, "mla_softmax_scale": mla, "split_kv_b": mla, "yarn_get_mscale": mla,
    "O1DeviceView": o1, "O1HeadView": o1, "O1Snapshot": o1,
    "LatentSlot": latent,
}


def test_all_is_the_small_public_api():
    assert set(kc.__all__) == TOP
    assert len(kc.__all__) == len(TOP)
    for name in kc.__all__:
        getattr(kc, name)                       # every listed name is there, without a warning


def test_errors_are_exceptions():
    assert issubclass(kc.WireError, ValueError)
    assert issubclass(kc.RebindRefused, RuntimeError)
    assert kc.RebindRefused is rebind.RebindRefused


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_warn_name_their_home_and_still_work(name):
    home = MOVED[name]
    assert name in home.__all__
    msg = rf"^kvcache\.{name} is deprecated; use {home.__name__}\.{name}$"
    with pytest.warns(DeprecationWarning, match=msg) as rec:
        old = getattr(kc, name)
    assert old is getattr(home, name)
    assert rec[0].filename == __file__        # attributed to the line that read the name
    assert name not in kc.__all__ and name not in dir(kc)


def test_moved_function_still_computes():
    with pytest.warns(DeprecationWarning, match="use kvcache.mla.mla_softmax_scale"):
        old = kc.mla_softmax_scale(128, 64, None)
    assert old == mla.mla_softmax_scale(128, 64, None)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        kc.no_such_name                          # noqa: B018
    assert not hasattr(kc, "no_such_name")


def test_import_kvcache_does_not_import_reference():
    code = ("import sys, warnings; warnings.simplefilter('error'); import kvcache as kc; "
            "assert 'kvcache.reference' not in sys.modules, 'imported eagerly'; "
            "ref = kc.reference; "
            "assert sys.modules['kvcache.reference'] is ref; "
            "assert ref.__name__ == 'kvcache.reference'; "
            "assert 'reference' not in kc.__all__ and 'reference' in dir(kc); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n"


def test_reference_submodule_needs_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvcache import reference
        assert kc.reference is reference


def test_dir_lists_the_api_and_submodules_not_old_names():
    names = dir(kc)
    assert set(kc.__all__) <= set(names)
    assert {"mla", "rebind", "reference", "wire", "o1", "latent"} <= set(names)
    assert not set(MOVED) & set(names)
    assert names == sorted(names)


def test_homes_import_and_work():
    plan_cls = rebind.DecodePlan
    lc = kc.LatentKvCache.with_capacity(1, 4, [(2,), (1,)])
    plan = plan_cls.build(lc)
    assert plan.validity_for(lc) is rebind.PlanValidity.VALID
    assert isinstance(lc.alloc_id, rebind.KvAllocId)
    assert isinstance(lc.layers[0][0], latent.LatentSlot)
    assert np.isclose(mla.yarn_get_mscale(1.0), 1.0)


# -- the two backend protocols, named apart ---------------------------------------------------
@pytest.mark.parametrize("module,new", [("kvcache.store", "kvcache.store.StoreBackend"),
                                        ("kvcache.store.backend",
                                         "kvcache.store.backend.StoreBackend"),
                                        ("kvcache.device.backends",
                                         "kvcache.device.backends.DeviceBackend")])
def test_old_backend_names_warn_and_are_the_new_protocols(module, new):
    import importlib
    mod = importlib.import_module(module)
    home, _, name = new.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"^{module}\.Backend is deprecated; use {new}$"):
        old = mod.Backend
    assert old is getattr(importlib.import_module(home), name)
    assert "Backend" not in mod.__all__ and name in mod.__all__


def test_store_and_device_backends_are_distinct_protocols():
    from kvcache.device.backends import DeviceBackend
    from kvcache.store import MemoryBackend, StoreBackend
    assert StoreBackend is not DeviceBackend
    assert isinstance(MemoryBackend(), StoreBackend)
