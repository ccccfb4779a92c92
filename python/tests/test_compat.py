"""stowage._compat, the one module that uses Ray's and TransferQueue's
private APIs: it checks the installed version once, goes on with one
logged warning on a version it was not written for while the API is
there, and raises UnsupportedVersion naming both versions when it is not.
Also stowage.tq_worker's post-import hook (wrapt) and stowage.ray's
bounded calls."""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import time
import types

import drivers
import pytest

import stowage
from stowage import _compat

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'stowage-rl[ray]')",
)


@pytest.fixture
def fresh(monkeypatch, caplog):
    """A process whose versions were not checked yet."""
    monkeypatch.setattr(_compat, "_seen", {})
    caplog.set_level(logging.WARNING, logger="stowage.compat")
    return caplog


class _Id:
    def hex(self) -> str:
        return "ab12"


class _Handle:
    _actor_id = _Id()


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "stowage.compat"]


def _fake_tq(monkeypatch, version: str) -> None:
    module = types.ModuleType("transfer_queue")
    module.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transfer_queue", module)


def test_versions_match_what_the_extras_pin():
    assert _compat.supports(_compat.RAY, "2.60.0") and _compat.supports(_compat.RAY, "2.60.3")
    assert not _compat.supports(_compat.RAY, "2.61.0")
    assert not _compat.supports(_compat.RAY, "2.6")
    assert _compat.supports(_compat.TQ, "0.1.11")
    assert not _compat.supports(_compat.TQ, "0.1.110")
    assert not _compat.supports(_compat.TQ, "0.1.12")


@needs_ray
def test_a_supported_ray_is_used_without_a_warning(fresh, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "2.60.0")
    assert _compat.actor_id_hex(_Handle()) == "ab12"
    assert _warnings(fresh) == []


@needs_ray
def test_the_installed_ray_has_every_private_name_used():
    import ray

    if not _compat.supports(_compat.RAY, ray.__version__):
        pytest.skip(f"Ray {ray.__version__} is not the supported {_compat.RAY.supported}")
    for name in ("actors", "available_resources_per_node", "total_resources_per_node"):
        assert callable(_compat._attr(_compat.RAY, "ray._private.state", name))
    assert callable(_compat._attr(_compat.RAY, "ray.autoscaler.v2.sdk", "get_cluster_status"))


@needs_ray
def test_another_ray_with_the_api_works_with_one_warning(fresh, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "2.61.0")
    assert _compat.actor_id_hex(_Handle()) == "ab12"
    assert _compat.actor_id_hex(_Handle()) == "ab12"
    (warning,) = _warnings(fresh)
    assert "Ray 2.60" in warning and "Ray 2.61.0" in warning


@needs_ray
def test_another_ray_without_the_api_says_which_version_it_found(fresh, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "3.0.0")
    with pytest.raises(_compat.UnsupportedVersion) as e:
        _compat.actor_id_hex(object())
    assert isinstance(e.value, stowage.Error)
    assert "Ray 3.0.0" in str(e.value) and "supports Ray 2.60" in str(e.value)
    assert "_actor_id" in str(e.value)
    with pytest.raises(_compat.UnsupportedVersion, match=r"ray\._private\.state\.nothing_here"):
        _compat._attr(_compat.RAY, "ray._private.state", "nothing_here")
    assert len(_warnings(fresh)) == 1


def test_transferqueue_versions_are_checked_the_same_way(fresh, monkeypatch):
    meta = types.SimpleNamespace(_custom_backend_meta=[{"f": "x"}])
    _fake_tq(monkeypatch, "0.1.11")
    assert _compat.custom_backend_meta(meta) == [{"f": "x"}]
    assert _warnings(fresh) == []

    monkeypatch.setattr(_compat, "_seen", {})
    _fake_tq(monkeypatch, "0.2.0")
    assert _compat.custom_backend_meta(meta) == [{"f": "x"}]
    with pytest.raises(_compat.UnsupportedVersion) as e:
        _compat.custom_backend_meta(object())
    assert "TransferQueue 0.2.0" in str(e.value)
    assert "supports TransferQueue 0.1.11" in str(e.value)
    (warning,) = _warnings(fresh)
    assert "TransferQueue 0.1.11" in warning and "TransferQueue 0.2.0" in warning


def test_a_supported_version_missing_the_api_raises_as_it_is(fresh, monkeypatch):
    _fake_tq(monkeypatch, "0.1.11")
    with pytest.raises(AttributeError):
        _compat.custom_backend_meta(object())


# -- stowage.tq_worker: the post-import hook ---------------------------------


def test_setup_worker_imports_the_backend_once_transfer_queue_has_run(tmp_path):
    pkg = tmp_path / "transfer_queue"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("RAN = True\n")
    (pkg / "data.txt").write_text("resource")
    out = drivers.driver(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n",
        """
        import importlib, importlib.resources
        import stowage.tq_worker as w

        seen = []

        def record(name):
            tq = sys.modules["transfer_queue"]
            seen.append((name, getattr(tq, "RAN", False)))

        w.importlib = type("I", (), {"import_module": staticmethod(record)})
        w.setup_worker()
        w.setup_worker()
        print("BEFORE", seen)
        import transfer_queue
        print("AFTER", seen)
        loader = transfer_queue.__loader__
        print("LOADER", type(loader).__name__, type(transfer_queue.__spec__.loader).__name__)
        print("RESOURCE", importlib.resources.files("transfer_queue").joinpath("data.txt").read_text())
        w.setup_worker()
        print("AGAIN", seen)
        """,
        60,
    )
    assert drivers.line(out, "BEFORE") == "[]"
    assert drivers.line(out, "AFTER") == "[('stowage.tq', True)]"
    assert drivers.line(out, "LOADER") == "SourceFileLoader SourceFileLoader"
    assert drivers.line(out, "RESOURCE") == "resource"
    assert drivers.line(out, "AGAIN") == "[('stowage.tq', True), ('stowage.tq', True)]"


# -- stowage.ray: calls with a time limit --------------------------------------


@needs_ray
def test_bounded_calls_return_what_finished_in_time_and_none_for_the_rest():
    from stowage.ray import _bounded, _bounded_all

    release = threading.Event()

    def stuck():
        release.wait(30)
        return "late"

    def fails():
        raise RuntimeError("no")

    try:
        t0 = time.monotonic()
        assert _bounded_all([lambda: 1, stuck, fails, lambda: "two"], 0.3) == [
            1,
            None,
            None,
            "two",
        ]
        assert _bounded(stuck, 0.2) is None
        assert time.monotonic() - t0 < 5
        assert _bounded(lambda: {"State": "ALIVE"}, 5) == {"State": "ALIVE"}
        assert _bounded(fails, 5) is None
    finally:
        release.set()
