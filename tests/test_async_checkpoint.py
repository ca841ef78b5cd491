"""Asynchronous checkpoints (``async_checkpoint=True``, issue 48 part 3): what an asynchronous save writes is bitwise
what a synchronous save of the same step writes, though training changed the states while it was written; the next
save waits for the previous one, training runs while a save is written, and a write that fails leaves the previous
checkpoint in place, complete, found by ``last``. One launch of ``tests/scripts/async_checkpoint.py`` (2 CPU ranks,
gloo) serves the slow tests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lightning_4d import FourDStrategy
from lightning_4d.checkpoint import AsyncSaves, check_complete, save_sharded
from tests._launch import SCRIPTS, torchrun

STEPS = 4
LAYOUTS = [{"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"tp": 2, "zero": 1}]
#: the seconds each shard write of an asynchronous run sleeps first: training changes the states meanwhile
WRITE_DELAY = 0.5


def _folder_contents(path: Path) -> dict:
    """Everything a sharded folder's shards hold, read with torch's own converter (``dcp_to_torch_save``: no template,
    no model), as one flat dict (``"state_dict.<name>"``, ``"optimizer_0.state.<name>.exp_avg"``, ...)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_complete(path)
    flat = path.with_name(path.name + ".pt")
    dcp_to_torch_save(path, flat)
    nested = torch.load(flat, weights_only=False)
    flat.unlink()
    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            out[prefix[:-1]] = value

    walk("", nested)
    return out


def _assert_bitwise_equal(a: dict, b: dict, where: str) -> int:
    """``a == b`` key by key, tensors bitwise (dtype, shape, values); returns the number of tensor elements."""
    assert sorted(a) == sorted(b), (where, set(a) ^ set(b))
    elements = 0
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (where, key)
            assert torch.equal(a[key], b[key]), f"{where}: {key} differs"
            elements += a[key].numel()
        else:
            assert a[key] == b[key], (where, key, a[key], b[key])
    return elements


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_checkpoint")
    torchrun(
        2,
        SCRIPTS / "async_checkpoint.py",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--write-delay",
        str(WRITE_DELAY),
        "--layouts",
        json.dumps(LAYOUTS),
        timeout=900,
    )
    return out


def _record(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(x) for x in LAYOUTS])
def test_async_save_writes_bitwise_what_a_sync_save_writes(launched, index):
    sync, asynchronous = launched / f"sync{index}", launched / f"async{index}"
    assert _record(launched, f"async{index}")["losses"] == _record(launched, f"sync{index}")["losses"]
    names = [f"step={k}.ckpt" for k in range(1, STEPS + 1)] + ["last.ckpt"]
    assert sorted(p.name for p in asynchronous.iterdir()) == sorted(names)  # no .tmp or .old left
    previous = None
    for name in names:
        reference = _folder_contents(sync / name)
        got = _folder_contents(asynchronous / name)
        elements = _assert_bitwise_equal(got, reference, name)
        assert elements > 100_000  # the model's weights and Adam's states, not an empty folder
        meta = torch.load(asynchronous / name / "meta.pt", weights_only=False)
        assert meta["global_step"] == (STEPS if name == "last.ckpt" else int(name[5:-5]))
        if previous is not None and name != "last.ckpt":  # training changed the weights between two saves
            assert not torch.equal(got["state_dict.model.output.weight"], previous)
        previous = got["state_dict.model.output.weight"]


@pytest.mark.slow
def test_next_save_waits_for_the_previous_and_training_runs_meanwhile(launched):
    events = _record(launched, "async0")["events"]
    staged = [(t, name) for kind, t, name in events if kind == "staged"]
    renamed = [(t, name) for kind, t, name in events if kind == "renamed"]
    blocking = [s for kind, s, _ in events if kind == "blocking"]
    steps = [t for kind, t, _ in events if kind == "step_end"]
    assert [n for _, n in staged] == [n for _, n in renamed] and len(staged) == 2 * STEPS
    for i in range(1, len(staged)):  # save i is staged only after save i-1 was renamed into place
        assert renamed[i - 1][0] <= staged[i][0], (renamed[i - 1], staged[i])
    # training steps ended while a save was being written (between its staging and its rename)
    overlapped = [s for s in steps if any(t0 < s < t1 for (t0, _), (t1, _) in zip(staged, renamed))]
    assert len(overlapped) >= STEPS - 1, (staged, renamed, steps)
    # each save blocked training for less than its write takes (the write sleeps WRITE_DELAY first)
    assert max(blocking) < WRITE_DELAY, blocking


@pytest.mark.slow
def test_a_failed_write_keeps_the_previous_checkpoint_and_last(launched):
    from lightning_4d.parallel._compat.lightning import resolve_ckpt_path

    record = _record(launched, "fail")
    folder = launched / "fail"
    # the 4th save (last.ckpt of step 2) failed on rank 1: the 5th save (step=3.ckpt) raised, naming it and the cause
    assert record["error"].startswith(f"the asynchronous save of checkpoint '{folder / 'last.ckpt'}' failed")
    assert "rank 1: OSError: injected write failure" in record["error"]
    assert "the previous checkpoint at that path is kept" in record["error"]
    assert sorted(record["losses"]) == ["1", "2", "3"]
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "last.ckpt.tmp", "step=1.ckpt", "step=2.ckpt"]
    # last.ckpt is still step 1's complete folder: bitwise the synchronous run's step 1
    assert torch.load(folder / "last.ckpt" / "meta.pt", weights_only=False)["global_step"] == 1
    _assert_bitwise_equal(
        _folder_contents(folder / "last.ckpt"), _folder_contents(launched / "sync0" / "step=1.ckpt"), ""
    )
    assert not (folder / "last.ckpt.tmp" / ".metadata").exists()  # the failed write never completed

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[ModelCheckpoint(dirpath=folder)])
    assert Path(resolve_ckpt_path(trainer, "fit", "last")) == folder / "last.ckpt"


def test_async_saves_wait_raises_one_line_naming_the_checkpoint_and_the_failed_rank(tmp_path, monkeypatch):
    """In one process: a write that raises fails the save at ``wait``, the folder it replaced stays in place; the
    next save writes."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    state = {"w": torch.arange(12.0).reshape(3, 4)}
    saves = AsyncSaves()
    path = tmp_path / "last.ckpt"
    save_sharded({"state_dict": dict(state), "step": 1}, path, 0, lambda: None, saves=saves)
    saves.wait()
    check_complete(path)

    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    save_sharded({"state_dict": {"w": state["w"] + 1}, "step": 2}, path, 0, lambda: None, saves=saves)
    with pytest.raises(RuntimeError, match=r"checkpoint '.*last.ckpt' failed \(.*OSError: disk full\)") as err:
        saves.wait()
    assert "\n" not in str(err.value)
    assert torch.load(path / "meta.pt", weights_only=False)["step"] == 1
    assert torch.equal(_folder_contents(path)["state_dict.w"], state["w"])
    monkeypatch.undo()
    save_sharded({"state_dict": {"w": state["w"] + 2}, "step": 3}, path, 0, lambda: None, saves=saves)
    saves.close()
    assert torch.equal(_folder_contents(path)["state_dict.w"], state["w"] + 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_async_save_stages_before_returning(tmp_path, monkeypatch):
    """In one process: the state handed to a save is copied before the save returns (training may change it next):
    changing the tensor in place after ``save_sharded`` returned, while the write still waits, does not reach the
    folder; the next save waits for the slow write."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(0.5)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow)
    weight = torch.arange(12.0).reshape(3, 4)
    expected = weight.clone()
    saves = AsyncSaves()
    begin = time.perf_counter()
    save_sharded({"state_dict": {"w": weight}}, tmp_path / "a.ckpt", 0, lambda: None, saves=saves)
    returned = time.perf_counter() - begin
    weight.mul_(-1)  # the next optimizer step
    assert saves.pending == tmp_path / "a.ckpt" and not (tmp_path / "a.ckpt").exists()
    save_sharded({"state_dict": {"w": weight}}, tmp_path / "b.ckpt", 0, lambda: None, saves=saves)
    assert (tmp_path / "a.ckpt").is_dir()  # the second save waited for the first's write and rename
    saves.close()
    assert returned < 0.5
    assert torch.equal(_folder_contents(tmp_path / "a.ckpt")["state_dict.w"], expected)
    assert torch.equal(_folder_contents(tmp_path / "b.ckpt")["state_dict.w"], -expected)


def test_async_checkpoint_needs_a_sharded_folder():
    with pytest.raises(ValueError, match="async_checkpoint=True is not supported with save_distributed_checkpoint"):
        FourDStrategy(async_checkpoint=True, save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match=r"^async_checkpoint='yes' is not valid: expected True or False.$"):
        FourDStrategy(async_checkpoint="yes")
    assert FourDStrategy(async_checkpoint=True).async_saves is not None
    assert FourDStrategy().async_saves is None
