"""Loading a file never runs its code (issue 37): every read of a checkpoint goes through
:mod:`lightning_4d.safe_load`, and a crafted checkpoint whose pickle runs a shell command (``tests/_crafted.py``: it
creates a marker file) is refused at every entry point in one line, the marker never created."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from lightning_4d import safe_load
from tests._crafted import RunsCode, crafted_file, crafted_folder
from tests._launch import ROOT, SCRIPTS, python_run, torchrun

PACKAGE = ROOT / "lightning_4d"


def test_package_loads_through_one_loader_and_never_opts_out():
    """No ``weights_only=False`` anywhere in the package; ``torch.load`` and ``pickle.load`` only in safe_load.py."""
    import ast

    for file in sorted(PACKAGE.rglob("*.py")):
        text = file.read_text()
        assert not re.search(r"weights_only\s*=\s*False", text), f"{file}: weights_only=False"
        calls = {
            f"{node.func.value.id}.{node.func.attr}"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
        }
        if file.name != "safe_load.py":
            assert not calls & {"torch.load", "pickle.load", "pickle.loads"}, f"{file}: load through safe_load"


def test_the_crafted_file_runs_its_payload_when_unpickled(tmp_path):
    """The payload is real (else the refusals below prove nothing): a plain unpickling runs it."""
    marker = tmp_path / "marker"
    crafted_file(tmp_path / "x.ckpt", marker)
    torch.load(tmp_path / "x.ckpt", weights_only=False)  # the unsafe load the package never does
    assert marker.exists()


def test_loader_refuses_in_one_line_before_anything_runs(tmp_path):
    marker = tmp_path / "marker"
    path = crafted_file(tmp_path / "x.ckpt", marker)
    for call in (safe_load.load, safe_load.check_checkpoint):
        with pytest.raises(ValueError) as info:
            call(path)
        message = str(info.value)
        assert isinstance(info.value, safe_load.UnsafeFileError)
        assert "\n" not in message and str(path) in message and "posix.system" in message and "re-save" in message
    # torch's legacy (non-zip) format: the static check cannot read it, the weights-only unpickler refuses it
    torch.save({"x": RunsCode(marker)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(safe_load.UnsafeFileError, match=r"refusing to load .*old\.pt.*GLOBAL posix\.system"):
        safe_load.check_checkpoint(tmp_path / "old.pt")
    assert not marker.exists()
    # what we save loads: tensors, plain data and our config type
    from lightning_4d.models import LlamaConfig

    torch.save({"w": torch.ones(2), "cfg": LlamaConfig.from_preset("tiny-test"), "n": [1, (2.0, "x")]}, tmp_path / "ok")
    assert safe_load.load(tmp_path / "ok")["cfg"] == LlamaConfig.from_preset("tiny-test")
    with pytest.raises(ValueError, match="not a readable torch.save file"):
        (tmp_path / "junk").write_bytes(b"not a checkpoint")
        safe_load.load(tmp_path / "junk")


def test_dcp_non_tensor_entry_is_read_weights_only(tmp_path):
    """torch's DefaultLoadPlanner unpickles a DCP folder's non-tensor entries with weights_only=False; ours not."""
    import torch.distributed.checkpoint as dcp

    from lightning_4d.checkpoint import read_folder

    marker = tmp_path / "marker"
    dcp.save({"w": torch.ones(3), "extra": RunsCode(marker)}, checkpoint_id=tmp_path / "f", no_dist=True)
    with pytest.raises(safe_load.UnsafeFileError, match=r"'extra'.*posix\.system"):
        read_folder({"w": torch.zeros(3), "extra": None}, tmp_path / "f", no_dist=True)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ entry points
@pytest.fixture(scope="module")
def strategy_loads(tmp_path_factory):
    """Trainer.fit / validate / predict (ckpt_path=) of crafted files through FourDStrategy's load_checkpoint, in
    one process (``tests/scripts/crafted_checkpoints.py``); its good folder serves the CLI tests."""
    out = tmp_path_factory.mktemp("crafted")
    torchrun(1, SCRIPTS / "crafted_checkpoints.py", "--out", str(out), timeout=300)
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "file"),
    [
        ("fit full file", "full.ckpt"),
        ("fit folder metadata", "meta.ckpt/meta.pt"),
        ("fit earlier optimizer files", "legacy.ckpt/zero1_optimizer_0_rank0.pt"),
        ("fit dcp metadata", "dcp.ckpt/.metadata"),
        ("validate full file", "full.ckpt"),
        ("predict full file", "full.ckpt"),
    ],
)
def test_trainer_ckpt_path_refuses_crafted_files(strategy_loads, case, file):
    out, results = strategy_loads
    assert results[case].startswith(f"UnsafeFileError: refusing to load {str(out / file)!r}: it holds posix.system")
    assert results[case + " marker"] is False
    assert results["good folder"] == "loaded"  # the safe reader reads what the strategy writes


def _cli(*args: str) -> subprocess.CompletedProcess:
    return python_run("-m", "lightning_4d", *args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "kind"),
    [
        ("export-hf", "file"),
        ("export-hf", "meta"),
        ("fit", "file"),
        ("fit", "meta"),
        ("fit", "legacy"),
        ("validate", "file"),
        ("test", "file"),
        ("predict", "file"),
        ("fit --model.init_from", "file"),
    ],
)
def test_cli_refuses_crafted_files_with_exit_2(strategy_loads, tmp_path, command, kind):
    good = strategy_loads[0] / "good.ckpt"
    marker = tmp_path / "marker"
    bad = (
        crafted_file(tmp_path / "x.ckpt", marker)
        if kind == "file"
        else crafted_folder(good, tmp_path / "x", marker, kind)
    )
    named = bad / "meta.pt" if kind == "meta" else bad / "zero1_optimizer_0_rank0.pt" if kind == "legacy" else bad
    if command == "export-hf":
        proc = _cli("export-hf", str(bad), str(tmp_path / "out"))
    else:
        option = "--model.init_from" if "init_from" in command else "--ckpt_path"
        proc = _cli(command.split()[0], "--config", "configs/tiny.yaml", f"{option}={bad}", "--trainer.logger=false")
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"refusing to load {str(named)!r}: it holds posix.system" in errors[0]
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_init_from_refuses_a_crafted_file_in_python(tmp_path):
    from lightning_4d.tasks import CausalLMModule

    marker = tmp_path / "marker"
    with pytest.raises(ValueError, match=r"refusing to load .*x\.ckpt.*posix\.system"):
        CausalLMModule("tiny-test", init_from=str(crafted_file(tmp_path / "x.ckpt", marker)))
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("other model wider", "tensor 'model.tok_embeddings.weight' has shape (256, 64) there, (256, 128)"),
        ("other model shallower", "it holds tensor 'model.layers.1.attention.wk.weight' (32, 64) that the model lacks"),
    ],
)
def test_trainer_ckpt_path_of_another_model_names_the_first_differing_tensor(strategy_loads, case, message):
    out, results = strategy_loads
    assert results[case].startswith(f"ValueError: checkpoint {str(out / 'good.ckpt')!r} is from another model: ")
    assert message in results[case] and "\n" not in results[case]


def test_loading_keeps_our_types_allowed_for_lightnings_own_loads(tmp_path):
    """Our loader leaves ``LlamaConfig`` and ``RopeScaling`` allowed process-wide: torch's ``safe_globals`` context
    manager, used before, removed them on exit although importing the package had allowed them, and Lightning's own
    ``torch.load(weights_only=True)`` of a checkpoint holding a ``LlamaConfig`` (``Trainer.fit(ckpt_path=...)`` with
    ``CausalLMModule``) then failed with "Unsupported global" (seen running tests/test_resume.py after a test that
    read a checkpoint folder)."""
    from lightning_4d.models.llama_config import LlamaConfig, RopeScaling
    from lightning_4d.safe_load import load

    path = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, path)
    load(path)
    load(path, mmap=False)
    allowed = torch.serialization.get_safe_globals()
    assert LlamaConfig in allowed and RopeScaling in allowed
    cfg_path = tmp_path / "config.pt"
    torch.save({"hyper_parameters": {"model_config": LlamaConfig.from_preset("tiny-test")}}, cfg_path)
    loaded = torch.load(cfg_path, weights_only=True)  # as Lightning loads it
    assert loaded["hyper_parameters"]["model_config"] == LlamaConfig.from_preset("tiny-test")


@pytest.mark.parametrize("name", ["../victim/x.distcp", "/etc/passwd", "a/../../x", "", "link/x.distcp"])
def test_a_checkpoint_names_files_inside_its_folder_only(tmp_path, name):
    """A DCP shard's ``relative_path`` or a safetensors index entry that leaves the folder (``..``, absolute, a symlink
    out) is refused by name before the file is looked at (no read, no existence probe)."""
    from lightning_4d.safe_load import confined

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (tmp_path / "outside").mkdir()
    (folder / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="is not inside"):
        confined(folder, name, "the index")
    assert confined(folder, "__0_0.distcp", "the index") == folder / "__0_0.distcp"
    assert confined(folder, "sub/model-00001.safetensors", "the index") == folder / "sub/model-00001.safetensors"


def test_a_crafted_index_cannot_probe_files_outside(tmp_path):
    import json

    from lightning_4d.families.hf_io import _check_shards

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "../../../root/.ssh/id_rsa"}})
    )
    with pytest.raises(ValueError, match="'../../../root/.ssh/id_rsa', which is not inside"):
        _check_shards(tmp_path)


def test_dcp_metadata_admits_the_listed_classes_only(tmp_path):
    """An unlisted dataclass or Enum of torch.distributed.checkpoint (once admitted as any dataclass or Enum of DCP)
    is refused by name; a ``BUILD`` that sets attributes on an admitted class (``pathlib.PosixPath.glob =
    frozenset`` for the whole process) is refused before it runs."""
    import pathlib
    import pickle

    from lightning_4d.safe_load import DCP_METADATA_CLASSES, UnsafeFileError, read_dcp_metadata

    assert ("torch.distributed.checkpoint.metadata", "Metadata") in DCP_METADATA_CLASSES
    for module, name in [
        ("torch.distributed.checkpoint.planner", "WriteItemType"),  # an Enum of DCP
        ("torch.distributed.checkpoint.planner", "ReadItem"),  # a dataclass of DCP
        ("enum", "Enum"),
    ]:
        (tmp_path / ".metadata").write_bytes(b"\x80\x04" + pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.STOP)
        with pytest.raises(UnsafeFileError, match=f"{module}.{name}"):
            read_dcp_metadata(tmp_path)
    glob = pathlib.PosixPath.glob
    patch = b"\x80\x04" + pickle.GLOBAL + b"pathlib\nPosixPath\n" + pickle.NONE + pickle.EMPTY_DICT
    patch += pickle.SHORT_BINUNICODE + bytes([4]) + b"glob" + pickle.GLOBAL + b"builtins\nfrozenset\n"
    patch += pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    (tmp_path / ".metadata").write_bytes(patch)
    with pytest.raises(UnsafeFileError, match="BUILD on a class"):
        read_dcp_metadata(tmp_path)
    assert pathlib.PosixPath.glob is glob
