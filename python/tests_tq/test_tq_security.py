"""No code from the data path, and checkpoints that stay inside themselves
(issue 21): the TransferQueue backend never unpickles a cell that this
job's clients did not write there, and a checkpoint's record cannot lead a
restore outside the checkpoint.

"Another process" here is a separate Python process that writes a unit's
rows directly (as anyone who can write them could): it has the units'
address, but not the cell key. The values it writes are pickles that would
create a file when unpickled; every test asserts the file never appears.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

tq = pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)
torch = pytest.importorskip("torch", reason="TransferQueue needs torch")

import ray  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import interface  # noqa: E402

import stowage  # noqa: E402
import stowage.tq  # noqa: E402

NS = "transfer_queue"
#: The head of a pickled cell as stowage before cell tags wrote it (and
#: read it, unpickling whatever followed).
OLD_HEAD = b"STWPKL5\x00"


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def _secret_file(dirpath) -> str:
    os.makedirs(dirpath, mode=0o700, exist_ok=True)
    path = os.path.join(dirpath, "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


@pytest.fixture
def secret_file(tmp_path):
    return _secret_file(str(tmp_path / "secret-a"))


def _conf(**block):
    return OmegaConf.create(
        {
            "controller": {"polling_mode": True},
            "backend": {
                "storage_backend": "Stowage",
                "Stowage": {"count": 2, "memory": "64MiB", **block},
            },
        }
    )


@pytest.fixture
def system(secret_file, tmp_path):
    """Two units with a secret, checkpoints allowed under tmp_path."""
    tq.init(_conf(secret_file=secret_file, checkpoint_root=str(tmp_path)))
    yield interface._TQ_STORAGE["Stowage"]
    tq.close()


def _gidx(partition, keys):
    ctl = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    snap = ray.get(ctl.get_partition_snapshot.remote(partition))
    return [snap.keys_mapping[k] for k in keys]


class _WritesAFile:
    """Unpickling this creates the file ``path`` (as the job's user)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil(path) -> bytes:
    return pickle.dumps(_WritesAFile(path), protocol=5)


_OTHER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import stowage
    directory, secret_file, op = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with open(secret_file, "rb") as f:
        secret = f.read().strip()
    plane = stowage.connect(directory, namespace=op["ns"], secret=secret)
    if op["what"] == "write":
        plane.put(op["partition"], [op["row"]],
                  {op["field"]: [np.frombuffer(bytes.fromhex(op["bytes"]), np.uint8)]})
    else:  # move: the raw cell of one row, written into another
        raw = plane.get(op["partition"], [op["src"]], [op["field"]])[op["field"]][0]
        plane.put(op["partition"], [op["dst"]], {op["field"]: [np.ascontiguousarray(raw)]})
    plane.close()
    print("written")
    """
)


def _other_process(storage, tmp_path, secret_file, **op):
    """Another process writes a unit's rows directly."""
    directory = tmp_path / "directory.json"
    directory.write_text(json.dumps(storage.directory))
    op.setdefault("ns", NS)
    done = subprocess.run(
        [sys.executable, "-c", _OTHER, str(directory), secret_file, json.dumps(op)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "written" in done.stdout, done.stderr


def _raised(f, *args, **kwargs):
    """The exception ``f`` raised (None if it returned)."""
    try:
        f(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


def _put_text(keys, partition="p", field="text"):
    tq.kv_batch_put(
        keys=keys,
        partition_id=partition,
        fields=TensorDict({field: [f"value of {k}" for k in keys]}, batch_size=len(keys)),
        tags=[{} for _ in keys],
    )
    return _gidx(partition, keys)


@pytest.mark.parametrize("forged", ["untagged", "bad-tag"])
def test_tampered_pickled_cell_is_refused_and_never_unpickled(
    system, tmp_path, secret_file, forged
):
    keys = ["a", "b"]
    gidx = _put_text(keys)
    assert list(tq.kv_batch_get(keys=keys, partition_id="p")["text"]) == [
        "value of a",
        "value of b",
    ]
    target = tmp_path / "written-by-the-pickle"
    payload = _evil(str(target))
    # "untagged": a cell as stowage wrote them before tags; "bad-tag": the
    # tagged head with a tag made without the key.
    raw = OLD_HEAD + payload if forged == "untagged" else b"STWPKH1\x00" + os.urandom(32) + payload
    _other_process(
        system,
        tmp_path,
        secret_file,
        what="write",
        partition="p",
        row=gidx[1],
        field="text",
        bytes=raw.hex(),
    )
    err = _raised(tq.kv_batch_get, keys=keys, partition_id="p")
    assert not target.exists(), "a cell that another process wrote was unpickled"
    assert isinstance(err, stowage.tq.UntrustedCell), repr(err)
    assert f"row {gidx[1]!r} field 'text'" in str(err), str(err)
    assert "refusing to unpickle" in str(err)
    # The untouched row still reads back.
    assert list(tq.kv_batch_get(keys=["a"], partition_id="p")["text"]) == ["value of a"]


def test_cell_moved_to_another_row_or_field_is_refused(system, tmp_path, secret_file):
    keys = ["a", "b"]
    gidx = _put_text(keys)
    tq.kv_batch_put(
        keys=keys,
        partition_id="p",
        fields=TensorDict({"note": ["note a", "note b"]}, batch_size=2),
        tags=[{}, {}],
    )
    # Row a's cell, copied whole (tag and all) over row b's.
    _other_process(
        system,
        tmp_path,
        secret_file,
        what="move",
        partition="p",
        src=gidx[0],
        dst=gidx[1],
        field="text",
    )
    with pytest.raises(Exception) as info:
        tq.kv_batch_get(keys=["b"], partition_id="p", select_fields=["text"])
    assert isinstance(info.value, stowage.tq.UntrustedCell), repr(info.value)
    assert "its tag is wrong" in str(info.value), str(info.value)
    # And another field's cell of the same row.
    plane = stowage.connect(
        system.directory, namespace=NS, secret=open(secret_file, "rb").read().strip()
    )
    try:
        note = plane.get("p", [gidx[0]], ["note"])["note"][0]
        plane.put("p", [gidx[0]], {"text": [note]})
    finally:
        plane.close()
    with pytest.raises(stowage.tq.UntrustedCell):
        tq.kv_batch_get(keys=["a"], partition_id="p", select_fields=["text"])


def test_without_a_secret_pickled_cells_need_the_explicit_option(tmp_path):
    # auth.insecure: units and clients without a secret, so no cell key.
    tq.init(_conf(insecure=True))
    try:
        with pytest.raises(Exception) as info:
            _put_text(["a"])
        assert isinstance(info.value, stowage.tq.UntrustedCell), repr(info.value)
        assert "backend.Stowage.insecure_pickles" in str(info.value), str(info.value)
        # Tensors need no tag.
        tq.kv_batch_put(
            keys=["t"],
            partition_id="p",
            fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=1),
            tags=[{}],
        )
    finally:
        tq.close()
    tq.init(_conf(insecure=True, insecure_pickles=True))
    try:
        _put_text(["a"])
        assert list(tq.kv_batch_get(keys=["a"], partition_id="p")["text"]) == ["value of a"]
    finally:
        tq.close()


# -- checkpoints ----------------------------------------------------------------


def _record(ckpt):
    return json.loads((ckpt / "stowage_checkpoint.json").read_text())


def _write_record(ckpt, record):
    (ckpt / "stowage_checkpoint.json").write_text(json.dumps(record))


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_checkpoint_record_naming_a_path_outside_is_refused(system, tmp_path, where):
    keys = [f"k{i}" for i in range(4)]
    tq.kv_batch_put(
        keys=keys,
        partition_id="p",
        fields=TensorDict({"x": torch.arange(4.0).reshape(4, 1)}, batch_size=4),
        tags=[{} for _ in keys],
    )
    outside = tmp_path / "outside"
    tq.save_checkpoint(str(outside))  # a real checkpoint, with other rows
    tq.kv_batch_put(
        keys=keys,
        partition_id="p",
        fields=TensorDict({"x": torch.full((4, 1), 7.0)}, batch_size=4),
        tags=[{} for _ in keys],
    )
    ckpt = tmp_path / "ckpt" / "inner"
    tq.save_checkpoint(str(ckpt))
    record = _record(ckpt)
    theirs = _record(outside)["units"][0]["dir"]
    if where == "absolute":
        record["units"][0]["dir"] = str(outside / theirs)
    elif where == "dotdot":
        record["units"][0]["dir"] = f"../../outside/{theirs}"
    else:
        mine = ckpt / record["units"][0]["dir"]
        shutil.rmtree(mine)
        os.symlink(outside / theirs, mine)
    _write_record(ckpt, record)
    tq.kv_batch_put(
        keys=keys,
        partition_id="p",
        fields=TensorDict({"x": torch.full((4, 1), 9.0)}, batch_size=4),
        tags=[{} for _ in keys],
    )
    with pytest.raises(Exception) as info:
        tq.load_checkpoint(str(ckpt))
    assert isinstance(info.value, stowage.tq.CheckpointRefused), repr(info.value)
    msg = str(info.value)
    if where == "symlink":
        assert "symbolic link" in msg, msg
    else:
        assert "not a relative path inside the checkpoint" in msg and "'..'" in msg, msg
    # Nothing changed.
    got = tq.kv_batch_get(keys=keys, partition_id="p")["x"]
    assert torch.equal(torch.stack(list(got.unbind())), torch.full((4, 1), 9.0))


def test_checkpoint_record_cannot_size_the_restore_unit(system, tmp_path):
    tq.kv_batch_put(
        keys=["a"],
        partition_id="p",
        fields=TensorDict({"x": torch.ones(1, 4)}, batch_size=1),
        tags=[{}],
    )
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(str(ckpt))
    record = _record(ckpt)
    record["units"][0]["bytes"] = 1 << 50  # a PiB of memory for the temporary unit
    _write_record(ckpt, record)
    with pytest.raises(Exception) as info:
        tq.load_checkpoint(str(ckpt))
    assert isinstance(info.value, stowage.tq.CheckpointRefused), repr(info.value)
    assert str(1 << 50) in str(info.value) and "its files hold" in str(info.value), str(info.value)


def test_tampered_cell_in_a_checkpoint_is_refused_and_never_unpickled(
    system, tmp_path, secret_file
):
    keys = ["a", "b"]
    gidx = _put_text(keys)
    target = tmp_path / "written-by-the-pickle"
    _other_process(
        system,
        tmp_path,
        secret_file,
        what="write",
        partition="p",
        row=gidx[0],
        field="text",
        bytes=(OLD_HEAD + _evil(str(target))).hex(),
    )
    ckpt = tmp_path / "ckpt"
    tq.save_checkpoint(str(ckpt))  # the tampered cell goes into the checkpoint
    _put_text(keys)  # the live rows are good again
    err = _raised(
        lambda: (tq.load_checkpoint(str(ckpt)), tq.kv_batch_get(keys=keys, partition_id="p"))
    )
    assert not target.exists(), "a tampered cell of a checkpoint was unpickled"
    assert isinstance(err, stowage.tq.CheckpointRefused), repr(err)
    assert f"row {gidx[0]!r} field 'text'" in str(err), str(err)
    # Refused before anything changed: the live rows are intact.
    assert list(tq.kv_batch_get(keys=keys, partition_id="p")["text"]) == [
        "value of a",
        "value of b",
    ]


def test_checkpoint_saved_under_another_secret_needs_that_secret(tmp_path):
    old = _secret_file(str(tmp_path / "old"))
    new = _secret_file(str(tmp_path / "new"))
    ckpt = tmp_path / "ckpt"
    keys = ["a", "b", "c"]
    tq.init(_conf(secret_file=old, checkpoint_root=str(tmp_path)))
    try:
        _put_text(keys)
        tq.save_checkpoint(str(ckpt))
    finally:
        tq.close()
    tq.init(_conf(secret_file=new, checkpoint_root=str(tmp_path)))
    try:
        with pytest.raises(Exception) as info:
            tq.load_checkpoint(str(ckpt))
        assert isinstance(info.value, stowage.tq.CheckpointRefused), repr(info.value)
        assert "backend.Stowage.checkpoint_secret_file" in str(info.value), str(info.value)
    finally:
        tq.close()
    # Given the old secret, its cells are checked under it and re-tagged.
    tq.init(_conf(secret_file=new, checkpoint_secret_file=old, checkpoint_root=str(tmp_path)))
    try:
        tq.load_checkpoint(str(ckpt))
        got = tq.kv_batch_get(keys=keys, partition_id="p")["text"]
        assert list(got) == [f"value of {k}" for k in keys]
    finally:
        tq.close()


def test_default_checkpoint_root_is_private_and_not_slash(tmp_path, secret_file, monkeypatch):
    # The job's temporary directory: this test's own.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tq.init(_conf(secret_file=secret_file))
    try:
        root = tmp_path / f"stowage-tq-checkpoints-{os.getuid()}"
        st = os.lstat(root)
        assert (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and stat.S_IMODE(st.st_mode) == 0o700
        )
        tq.kv_batch_put(
            keys=["a"],
            partition_id="p",
            fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=1),
            tags=[{}],
        )
        # Anywhere else (here: beside the root) is refused by the units.
        with pytest.raises(Exception) as info:
            tq.save_checkpoint(str(tmp_path / "elsewhere"))
        assert "outside this unit's checkpoint root" in str(info.value), str(info.value)
        tq.save_checkpoint(str(root / "step-1"))
        assert (root / "step-1" / _record(root / "step-1")["units"][0]["dir"]).is_dir()
    finally:
        tq.close()


def test_default_checkpoint_root_planted_by_another_user_is_not_used(
    tmp_path, secret_file, monkeypatch
):
    # Another local user makes the default root first: the job still
    # starts, in a fresh private root of its own, and writes nothing into
    # the planted one.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    os.chmod(tmp_path, 0o777)
    planted = tmp_path / f"stowage-tq-checkpoints-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    conf = tq.init(_conf(secret_file=secret_file))
    try:
        root = conf.backend.Stowage.checkpoint_root
        assert os.path.dirname(root) == str(tmp_path), root
        assert os.path.basename(root).startswith(f"stowage-tq-checkpoints-{os.getuid()}-"), root
        st = os.lstat(root)
        assert (
            stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid()
            and stat.S_IMODE(st.st_mode) == 0o700
        )
        tq.kv_batch_put(
            keys=["a"],
            partition_id="p",
            fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=1),
            tags=[{}],
        )
        step = os.path.join(root, "step-1")
        tq.save_checkpoint(step)
        assert os.path.isdir(os.path.join(step, _record(Path(step))["units"][0]["dir"]))
        assert list(planted.iterdir()) == []
    finally:
        tq.close()


def test_a_configured_checkpoint_root_is_used_instead_of_the_default(
    tmp_path, secret_file, monkeypatch
):
    # backend.Stowage.checkpoint_root: the units write there, and only
    # there; the default root is not even made.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    mine = tmp_path / "mine"
    conf = tq.init(_conf(secret_file=secret_file, checkpoint_root=str(mine)))
    try:
        assert conf.backend.Stowage.checkpoint_root == str(mine)
        assert not (tmp_path / "tmp" / f"stowage-tq-checkpoints-{os.getuid()}").exists()
        tq.kv_batch_put(
            keys=["a"],
            partition_id="p",
            fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=1),
            tags=[{}],
        )
        with pytest.raises(Exception) as info:
            tq.save_checkpoint(str(tmp_path / "tmp" / "step-1"))
        assert "outside this unit's checkpoint root" in str(info.value), str(info.value)
        tq.save_checkpoint(str(mine / "step-1"))
        assert (mine / "step-1" / _record(mine / "step-1")["units"][0]["dir"]).is_dir()
    finally:
        tq.close()


def test_a_configured_unsafe_checkpoint_root_is_refused(tmp_path, secret_file):
    # A root the user names is never replaced: another user's is an error.
    os.chmod(tmp_path, 0o777)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(Exception) as info:
        tq.init(_conf(secret_file=secret_file, checkpoint_root=str(theirs)))
    assert str(theirs) in str(info.value), str(info.value)
    with pytest.raises(ValueError):
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
    assert list(theirs.iterdir()) == []


def test_the_planes_secret_is_in_no_printed_config(tmp_path):
    # The units generate the secret (no secret_file), so the directory
    # TransferQueue keeps in its config carries it: TransferQueue logs that
    # config at INFO and stores it in its controller.
    import logging

    seen = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger(interface.__name__)
    level = log.level
    log.setLevel(logging.INFO)
    keep = _Keep()
    log.addHandler(keep)
    try:
        conf = tq.init(_conf(checkpoint_root=str(tmp_path)))
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    try:
        secret = interface._TQ_STORAGE["Stowage"].directory["secret_hex"]
        assert len(secret) >= 32
        logged = [m for m in seen if "TransferQueue config" in m]
        assert logged and "Stowage" in logged[0], seen
        ctl = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        stored = ray.get(ctl.get_config.remote())
        for c in (conf, stored):
            for shown in (str(c), repr(c), OmegaConf.to_yaml(c), str(OmegaConf.to_container(c))):
                assert secret not in shown and "<redacted>" in shown, shown
        assert all(secret not in m for m in seen)
        # The stored config (pickled through Ray) still holds it...
        assert stored.backend.Stowage.directory.secret_hex.value == secret
        # ...and the clients connect with it: a pickled cell is tagged and
        # checked under the key derived from it.
        _put_text(["a"])
        assert list(tq.kv_batch_get(keys=["a"], partition_id="p")["text"]) == ["value of a"]
    finally:
        tq.close()
