"""The nixl transport from Python: a local plane whose units serve NIXL,
reached with one-sided transfers (UCX over tcp and cma on this host).

These need a package built with the nixl feature and the nixl-cu12
libraries on LD_LIBRARY_PATH: scripts/test-nixl provides both and sets
STOWAGE_TEST_NIXL=1; elsewhere they are skipped."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import stowage

pytestmark = pytest.mark.skipif(
    os.environ.get("STOWAGE_TEST_NIXL") != "1",
    reason="nixl tests run from scripts/test-nixl (nixl feature and libraries)",
)


def _columns(seed=0):
    rng = np.random.default_rng(seed)
    lens = [1, 1000, 300_000, 0]  # 300k int64: 2.4 MB, past the zero-copy threshold
    return {
        "ids": [rng.integers(0, 50_000, n, dtype=np.int64) for n in lens],
        "logprobs": rng.standard_normal((4, 7)).astype(np.float32),
    }


def _run_with_directory(code, directory, env=None):
    """Run `code` in another Python process with the plane's directory
    (which carries its secret) on its standard input, read into
    ``sys.argv[1]`` (bounded: 120 s)."""
    code = "import sys; sys.argv[1:] = [sys.stdin.read()]\n" + code
    return subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(directory),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_local_plane_over_nixl_round_trips_rows():
    cols = _columns()
    with stowage.local(units=2, memory="64MiB", transport="nixl") as dp:
        assert [s["transport"] for s in dp.stats()] == ["nixl", "nixl"]
        dp.put("p", [0, 1, 2, 3], cols)
        got = dp.get("p", [0, 1, 2, 3], ["ids", "logprobs"])
        for a, b in zip(got["ids"], cols["ids"]):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert np.array_equal(np.stack(got["logprobs"]), cols["logprobs"])
        out = {"ids": [np.empty_like(a) for a in cols["ids"]]}
        dp.get("p", [0, 1, 2, 3], ["ids"], out=out)
        assert all(np.array_equal(a, b) for a, b in zip(out["ids"], cols["ids"]))
        # Views need memory this process maps: refused over nixl.
        with pytest.raises(stowage.InvalidRequest):
            dp.get_view("p", [0], ["ids"])
        assert dp.clear_partition("p") == 8
        assert all(s["entries"] == 0 for s in dp.stats())


def test_arrays_a_nixl_get_returns_are_the_callers_own():
    # Over nixl a get READs each unit's values into a registered buffer of
    # the client's and lends it to the arrays (no copy): they must hold
    # their values after the rows are cleared and written again, and after
    # the plane is gone.
    cols = _columns(2)
    with stowage.local(units=2, memory="64MiB", transport="nixl") as dp:
        dp.put("p", [0, 1, 2, 3], cols)
        got = dp.get("p", [0, 1, 2, 3], ["ids", "logprobs"])
        assert dp.clear_partition("p") == 8
        dp.put(
            "p",
            [0, 1, 2, 3],
            {
                "ids": [np.full_like(a, 7) for a in cols["ids"]],
                "logprobs": np.zeros_like(cols["logprobs"]),
            },
        )
        again = dp.get("p", [0, 1, 2, 3], ["ids"])
        assert all((a == 7).all() for a in again["ids"])
    for a, b in zip(got["ids"], cols["ids"]):
        assert np.array_equal(a, b)
        assert a.ctypes.data % 64 == 0
    assert np.array_equal(np.stack(got["logprobs"]), cols["logprobs"])
    # They are the caller's to write, like any get's arrays.
    got["ids"][2][:] = -1
    assert (got["ids"][2] == -1).all() and np.array_equal(got["ids"][1], cols["ids"][1])


def test_another_process_connects_over_nixl_with_the_directory():
    cols = _columns(1)
    with stowage.local(units=2, memory="64MiB", transport="nixl") as dp:
        dp.put("p", [0, 1, 2, 3], cols)
        code = (
            "import json, sys, numpy as np, stowage\n"
            "d = json.loads(sys.argv[1])\n"
            "c = stowage.connect(d, transport='nixl', require_rdma=False)\n"
            "assert [s['transport'] for s in c.stats()] == ['nixl', 'nixl']\n"
            "g = c.get('p', [2], ['ids'])['ids'][0]\n"
            "print(int(g.sum()), g.size)\n"
        )
        r = _run_with_directory(code, dp.directory)
        assert r.returncode == 0, r.stderr
        want = cols["ids"][2]
        assert r.stdout.split() == [str(int(want.sum())), str(want.size)]


def test_require_rdma_refuses_ucx_over_tcp():
    with stowage.local(units=1, memory="16MiB", transport="nixl") as dp:
        env = dict(os.environ, UCX_TLS="tcp,cma,self")
        code = (
            "import json, sys, stowage\n"
            "try:\n"
            "    stowage.connect(json.loads(sys.argv[1]), transport='nixl')\n"
            "except stowage.InvalidRequest as e:\n"
            "    print('refused', 'require_rdma' in str(e))\n"
        )
        r = _run_with_directory(code, dp.directory, env)
        assert r.stdout.strip() == "refused True", (r.stdout, r.stderr)


def test_the_ray_launcher_starts_units_that_serve_nixl():
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    import stowage.ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        node = ray.get_runtime_context().get_node_id()
        cfg = {"units": {"memory": "32MiB", "cpus": 0, "nixl": True, "require_rdma": False}}
        units = stowage.ray.start_units(cfg, [node, node], timeout=120)
        try:
            cols = _columns(2)
            with stowage.connect(units.directory, transport="nixl", require_rdma=False) as dp:
                assert [s["transport"] for s in dp.stats()] == ["nixl", "nixl"]
                dp.put("p", [0, 1, 2, 3], cols)
                got = dp.get("p", [0, 1, 2, 3], ["ids"])["ids"]
                assert all(np.array_equal(a, b) for a, b in zip(got, cols["ids"]))
            # Units started without nixl are reached over tcp by the same
            # client settings.
            plain = stowage.ray.start_units(
                {"units": {"memory": "16MiB", "cpus": 0}}, [node], timeout=120
            )
            try:
                with stowage.connect(plain.directory, transport="nixl", require_rdma=False) as dp:
                    assert [s["transport"] for s in dp.stats()] == ["tcp"]
            finally:
                assert stowage.ray.stop_units(plain, timeout=30) == [[]]
        finally:
            assert stowage.ray.stop_units(units, timeout=30) == [[], []]
    finally:
        ray.shutdown()
