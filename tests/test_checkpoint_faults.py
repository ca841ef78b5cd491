"""Checkpoints under faults (issue 14): a SIGKILL during a save or mid-run never costs the previous checkpoint,
``last.ckpt`` stays loadable, the resumed run continues with the straight run's losses; a truncated shard file is
named in a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_4d.checkpoint import check_complete
from lightning_4d.export_hf import export_hf
from tests._launch import SCRIPTS, torchrun

STEPS, AT = 6, 3


def _run(out, tag, *args):
    fault_args = ["--out", str(out), "--tag", tag, "--steps", str(STEPS), "--at", str(AT), *args]
    return torchrun(2, SCRIPTS / "fault.py", *fault_args, timeout=300, check=False)


def _losses(out, tag):
    records = [json.loads(line) for line in (out / f"{tag}_rank0.jsonl").read_text().splitlines()]
    return {step: loss for step, loss in records}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    proc = _run(out, "straight")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, _losses(out, "straight")


# (kill point, the step last.ckpt holds afterwards)
CASES = [("save", AT - 1), ("rename", AT - 1), ("step", AT)]


@pytest.mark.slow
@pytest.mark.parametrize("kill,saved_step", CASES, ids=[c[0] for c in CASES])
def test_killed_run_resumes_from_last_with_the_straight_losses(tmp_path, straight, kill, saved_step):
    proc = _run(tmp_path, "killed", "--kill", kill)
    assert proc.returncode != 0, "the killed run should have failed"
    killed = _losses(tmp_path, "killed")
    assert max(killed) == AT  # steps 1..AT trained before the kill (a kill in a save comes after its step)
    last = tmp_path / "ckpt" / "last.ckpt"
    if kill == "rename":  # killed between the two renames: last.ckpt is gone, the previous one is complete
        assert not last.exists()
        check_complete(last.with_name("last.old.ckpt"))
    else:
        check_complete(last)
    proc = _run(tmp_path, "resumed", "--ckpt-path", "last")  # Lightning's lookup, as a requeued job resumes
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = _losses(tmp_path, "resumed")
    expected = {s: straight[1][s] for s in range(saved_step + 1, STEPS + 1)}
    print(f"\n{kill}: straight {expected}\n  resumed {resumed}")
    assert sorted(resumed) == sorted(expected)
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5)
    # the resumed run's saves replaced last.ckpt again and removed the stale .old
    check_complete(last)
    assert not last.with_name("last.old.ckpt").exists() and not last.with_name("last.ckpt.tmp").exists()


class _Crash(Exception):
    pass


def _folder(path, step):
    path.mkdir()
    (path / "step").write_text(str(step))


def _found_by_last(dirpath):
    """What Lightning's ``ckpt_path="last"`` loads from a ``ModelCheckpoint(dirpath=...)``: the newest (modification
    time) of the callback's ``last*.ckpt`` entries (Lightning's own lookup, through
    ``_compat.lightning.resolve_ckpt_path``)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_4d.parallel._compat.lightning import resolve_ckpt_path

    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)]
    )
    return resolve_ckpt_path(trainer, "fit", "last")


def test_a_crash_after_any_file_operation_of_a_save_leaves_last_a_complete_checkpoint(tmp_path, monkeypatch):
    """``last.ckpt`` (step 1) replaced by a complete ``last.ckpt.tmp`` (step 2), the process killed after each file
    operation of the replacement in turn: Lightning's ``"last"`` lookup then finds a complete folder (step 2 once it
    is in place, else step 1, never nothing, which would train from step 0 and delete both on its first save), and
    the next save leaves ``last.ckpt`` alone in the folder."""
    from lightning_4d import checkpoint

    real = {"rename": Path.rename, "rmtree": shutil.rmtree, "unlink": Path.unlink}
    operations = 0
    for crash_after in range(10):
        (tmp_path / "run").mkdir()
        dirpath = tmp_path / "run"
        last = dirpath / "last.ckpt"
        _folder(last, 1)
        _folder(dirpath / "last.ckpt.tmp", 2)
        done = {"n": 0}

        def counted(name):
            def op(*args, **kwargs):
                if done["n"] == crash_after:
                    raise _Crash
                done["n"] += 1
                return real[name](*args, **kwargs)

            return op

        monkeypatch.setattr(Path, "rename", counted("rename"))
        monkeypatch.setattr(Path, "unlink", counted("unlink"))
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree"))
        try:
            checkpoint._rename_into_place(dirpath / "last.ckpt.tmp", last)
            crashed = False
        except _Crash:
            crashed = True
        monkeypatch.undo()
        found = _found_by_last(dirpath)
        assert found is not None, f"crash after {crash_after} operations: the last lookup finds nothing"
        step = int((Path(found) / "step").read_text())
        assert step == (1 if (dirpath / "last.ckpt.tmp").exists() else 2), (crash_after, found)
        assert checkpoint.resolve(Path(found)) == Path(found)
        # the next save (a resumed run's) replaces last.ckpt and leaves nothing else
        shutil.rmtree(dirpath / "last.ckpt.tmp", ignore_errors=True)
        _folder(dirpath / "last.ckpt.tmp", 3)
        checkpoint._rename_into_place(dirpath / "last.ckpt.tmp", last)
        assert sorted(p.name for p in dirpath.iterdir()) == ["last.ckpt"]
        assert (last / "step").read_text() == "3"
        shutil.rmtree(dirpath)
        if not crashed:
            operations = done["n"]
            break
    assert operations == 3  # last.ckpt -> last.old.ckpt, the tmp -> last.ckpt, the old removed


def test_resolve_loads_the_folder_an_earlier_version_moved_aside(tmp_path):
    from lightning_4d import checkpoint

    _folder(tmp_path / "last.ckpt.old", 1)
    assert checkpoint.resolve(tmp_path / "last.ckpt") == tmp_path / "last.ckpt.old"


@pytest.mark.slow
def test_truncated_shard_file_is_named(tmp_path, straight):
    bad = tmp_path / "last.ckpt"
    shutil.copytree(straight[0] / "ckpt" / "last.ckpt", bad)
    shard = sorted(bad.glob("*.distcp"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"shard file '{shard.name}' is truncated"):
        check_complete(bad)
    with pytest.raises(ValueError, match="is truncated"):
        export_hf(bad, tmp_path / "hf")
    proc = _run(tmp_path, "truncated", "--ckpt-path", str(bad))
    assert proc.returncode != 0 and f"shard file '{shard.name}' is truncated" in proc.stderr


def test_export_hf_of_a_folder_prints_no_single_process_warning(tmp_path):
    """export-hf reads a sharded folder in one process (DCP ``no_dist``) on purpose: torch's UserWarning that it
    assumes a single process says nothing to the user, and is not shown."""
    import warnings

    import torch

    from lightning_4d.checkpoint import save_sharded
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule("tiny")
    module.configure_model()  # no Trainer: built and initialized on the CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save's own single-process warning is not the export's
        save_sharded(
            {"state_dict": module.state_dict(), "hyper_parameters": {"model_config": "tiny"}},
            tmp_path / "ckpt",
            0,
            lambda: None,
        )
    (tmp_path / "hf.tmp").mkdir()  # the user's own folder of that name: left alone (once deleted unasked)
    (tmp_path / "hf.tmp" / "mine.txt").write_text("keep")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert (out / "config.json").is_file()
    assert (tmp_path / "hf.tmp" / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "hf.tmp"]  # no folder of ours left
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "assuming the intent is to load in a single process" in m], messages
    assert not torch.distributed.is_initialized()


def test_a_shard_path_outside_the_folder_is_refused_unread(tmp_path):
    """A ``.metadata`` whose shard ``relative_path`` leaves the folder (``../victim/x.distcp``) is refused by
    ``check_complete`` (so by resume, ``init_from`` and ``export-hf``) naming the entry, before that file is read."""
    import pickle
    import warnings

    from lightning_4d.checkpoint import check_complete, save_sharded
    from lightning_4d.tasks import CausalLMModule

    module = CausalLMModule("tiny-test")
    module.configure_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded({"state_dict": module.state_dict()}, tmp_path / "ckpt", 0, lambda: None)
    check_complete(tmp_path / "ckpt")
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.copy(next((tmp_path / "ckpt").glob("*.distcp")), victim / "x.distcp")
    meta_file = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../victim/x.distcp"
    meta_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="'../victim/x.distcp', which is not inside"):
        check_complete(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="which is not inside"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
