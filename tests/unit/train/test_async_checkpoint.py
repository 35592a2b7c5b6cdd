"""checkpoint.async_save's parts in process: the host copy taken at the save, the writer thread's order and errors,
rank 0's wait for the other ranks' files. The whole path (2 ZeRO-3 ranks, resumed bit for bit, killed mid-write):
tests/e2e/test_train_e2e.py::test_resume_is_bit_identical_and_survives_kill_during_an_async_checkpoint."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from pipeline.train.async_checkpoint import (
    AsyncCheckpointEngine,
    BackgroundWriter,
    wait_for_ranks,
    written_marker,
)


def test_the_file_holds_the_state_at_the_save_not_at_the_write(tmp_path):
    flat = torch.arange(8, dtype=torch.float32)
    state = {"module": {"w": flat[2:6], "b": torch.ones(3, dtype=torch.bfloat16)},  # a view into a larger buffer
             "optimizer": {"state": [(torch.zeros(2), 7)], "param_groups": [{"lr": 0.5}]}}
    writer, release = BackgroundWriter(), threading.Event()
    writer.submit(release.wait)  # the write of the save below cannot start before the training thread moves on
    engine = AsyncCheckpointEngine(TorchCheckpointEngine(), writer)
    path = str(tmp_path / "states.pt")
    engine.save(state, path)
    flat.add_(100)  # the next optimizer step changes everything in place
    state["module"]["b"].mul_(3)
    state["optimizer"]["state"][0][0].fill_(9)
    state["optimizer"]["param_groups"][0]["lr"] = 0.25
    assert not os.path.exists(path)
    release.set()
    writer.wait()
    saved = torch.load(path, weights_only=False)
    assert torch.equal(saved["module"]["w"], torch.arange(2, 6, dtype=torch.float32))
    assert saved["module"]["b"].dtype == torch.bfloat16 and torch.equal(saved["module"]["b"], torch.ones(3))
    assert torch.equal(saved["optimizer"]["state"][0][0], torch.zeros(2)) and saved["optimizer"]["state"][0][1] == 7
    assert saved["optimizer"]["param_groups"] == [{"lr": 0.5}]
    assert saved["module"]["w"].untyped_storage().nbytes() == 16  # the view alone, not its whole buffer


def test_a_failed_write_stops_the_queue_and_is_raised_by_wait(tmp_path):
    writer = BackgroundWriter()

    def full_disk():
        raise OSError(28, "No space left on device", str(tmp_path / "a.pt"))

    writer.submit(full_disk)
    writer.submit(lambda: (tmp_path / "after").write_text("written"))
    with pytest.raises(OSError, match="No space left on device"):
        writer.wait()
    assert not (tmp_path / "after").exists()  # nothing after a failed file is written (no marker over a hole)
    writer.submit(lambda: (tmp_path / "next").write_text("written"))
    writer.wait()  # the error was handed over once; the writer takes new work
    assert (tmp_path / "next").exists()


def test_rank_0_completes_only_when_every_rank_wrote_its_files(tmp_path):
    for rank in (0, 2):
        open(written_marker(str(tmp_path), rank), "w").close()
    with pytest.raises(RuntimeError, match=r"rank 1 did not finish writing its checkpoint files within 0.2 s"):
        wait_for_ranks(str(tmp_path), 3, timeout_s=0.2)
    open(written_marker(str(tmp_path), 1), "w").close()
    wait_for_ranks(str(tmp_path), 3)
