"""A run owns its host_storage directory: fresh files, an exclusive lock, no symlinks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, tiny_synthetic
from lightning.pytorch.callbacks import ModelCheckpoint
from torchrec.streamable import Pipelineable

from lightning_hotcache import HotCacheStrategy
from lightning_hotcache.cache import HostDirectory, HostStorageInUseError, HostStore
from lightning_hotcache.cache.upload import RowUpload, batch_to_device
from models import DLRM

OPTIMIZER = {"name": "rowwise_adagrad", "lr": 0.05}


def data():
    return tiny_synthetic(scale=0.01, num_embeddings_cap=None, num_train_samples=1024, num_val_samples=256, batch_size=64)


def train(directory: Path, epochs: int = 1, ckpt_path: str | None = None, **trainer_kwargs) -> DLRM:
    pl.seed_everything(0)
    dm = data()
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    strategy = HotCacheStrategy(device_budget=0.05, host_storage=str(directory), profile_batches=4)
    trainer = cpu_trainer(strategy=strategy, max_epochs=epochs, **trainer_kwargs)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model


def assert_same_model(a: DLRM, b: DLRM) -> None:
    torch.testing.assert_close(a.state_dict(), b.state_dict(), rtol=0, atol=0)


def test_rerun_in_the_same_directory_starts_fresh(tmp_path) -> None:
    # Before: the second run reopened the files and kept the first run's Adagrad state.
    first = train(tmp_path / "rows")
    second = train(tmp_path / "rows")
    assert_same_model(first, second)


def test_resume_takes_row_state_from_the_checkpoint_not_leftover_files(tmp_path) -> None:
    straight = train(tmp_path / "straight", epochs=2)
    rows = tmp_path / "rows"
    checkpoints = tmp_path / "ckpt"
    train(rows, epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True)])
    train(rows, epochs=2)  # another run leaves its own (further trained) state in the files
    resumed = train(rows, epochs=2, ckpt_path=str(checkpoints / "last.ckpt"))
    assert_same_model(straight, resumed)


def test_second_owner_in_the_same_process_fails_fast(tmp_path) -> None:
    held = HostDirectory(tmp_path)
    with pytest.raises(HostStorageInUseError, match=rf"in use by this process \(pid {os.getpid()} .*an earlier fit"):
        HostDirectory(tmp_path)
    held.release()
    HostDirectory(tmp_path).release()  # free again once released


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path) -> None:
    # Issue 69 item 5: DataLoader workers inherited the lock, so after a worker error a retry in
    # the same process (a notebook) was refused "in use by pid <its own pid>".
    import signal

    held = HostDirectory(tmp_path)
    ready, started = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that outlives the fit
        os.write(started, b"1")  # after the fork's hooks ran
        signal.pause()
        os._exit(0)
    try:
        os.read(ready, 1)
        held.release()
        HostDirectory(tmp_path).release()  # free while the child lives
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_lock_names_the_other_process_and_dies_with_it(tmp_path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from lightning_hotcache.cache import HostDirectory
            lock = HostDirectory({str(tmp_path)!r})
            print("locked", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(HostStorageInUseError, match=f"pid {holder.pid}"):
            train(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    train(tmp_path)  # the kernel dropped the dead holder's lock


def test_lock_is_released_when_fit_fails(tmp_path) -> None:
    class Exploding(pl.Callback):
        def on_train_batch_end(self, *args, **kwargs) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(tmp_path, callbacks=[Exploding()])
    HostDirectory(tmp_path).release()


def test_second_fit_of_the_same_model_holds_the_lock_again(tmp_path) -> None:
    dm = data()
    model = DLRM(dm.tables, dm.num_dense_features, embedding_optimizer=OPTIMIZER)
    strategy = HotCacheStrategy(device_budget=0.05, host_storage=str(tmp_path), profile_batches=4)
    cpu_trainer(strategy=strategy, max_steps=2).fit(model, dm)
    HostDirectory(tmp_path).release()  # released after the first fit

    class Probe(pl.Callback):
        def on_train_batch_start(self, *args, **kwargs) -> None:
            with pytest.raises(HostStorageInUseError):
                HostDirectory(tmp_path)

    strategy = HotCacheStrategy(device_budget=0.05, host_storage=str(tmp_path), profile_batches=4)
    cpu_trainer(strategy=strategy, max_steps=1, callbacks=[Probe()]).fit(model, dm)


def test_symlinked_table_file_is_refused(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    rows = tmp_path / "rows"
    rows.mkdir()
    # The first table that is split (not wholly on the device) has a host file of this name.
    (rows / "t_cat_0.weight.f32").symlink_to(victim)
    directory = HostDirectory(rows)
    with pytest.raises(ValueError, match="symlink"):
        directory.create("t_cat_0.weight.f32", 10, 4)
    directory.release()
    assert victim.read_bytes() == b"precious"


def test_symlinked_per_rank_folder_is_refused(tmp_path) -> None:
    # Issue 29 item 5: with several processes each rank's tables go to host_storage/rank<r>, which
    # hotcache makes itself; a link planted there had the lock and table files made in its target.
    from lightning.fabric.plugins.environments import LightningEnvironment

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / HostDirectory.LOCK_NAME).write_text("precious")
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "rank1").symlink_to(victim)
    environment = LightningEnvironment()
    environment.set_world_size(2)
    environment.set_global_rank(1)
    strategy = HotCacheStrategy(host_storage=str(tmp_path / "rows"), cluster_environment=environment)
    with pytest.raises(ValueError, match=r"rows/rank1 is a symlink; hotcache makes each rank's folder"):
        strategy._rank_storage()
    environment.set_global_rank(0)  # another rank's folder, not a link: made as usual
    assert strategy._rank_storage() == str(tmp_path / "rows" / "rank0")
    assert (victim / HostDirectory.LOCK_NAME).read_text() == "precious"


def test_symlinked_lock_file_is_refused(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / HostDirectory.LOCK_NAME).symlink_to(victim)
    with pytest.raises(ValueError, match="symlink"):
        HostDirectory(tmp_path / "rows")
    assert victim.read_bytes() == b"precious"


def test_hard_linked_lock_file_is_refused(tmp_path) -> None:
    # Issue 23 item 8: before, the lock truncated the linked file and wrote its pid line into it.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "rows").mkdir()
    os.link(victim, tmp_path / "rows" / HostDirectory.LOCK_NAME)
    with pytest.raises(ValueError, match="is a hard link.*Remove it"):
        HostDirectory(tmp_path / "rows")
    assert victim.read_bytes() == b"precious"


def test_host_files_have_their_disk_space_reserved(tmp_path) -> None:
    # Issue 23 item 7: sparse files took their blocks on first write, and a full disk then
    # killed training with SIGBUS; now every block is allocated when the file is made.
    directory = HostDirectory(tmp_path / "rows")
    array = directory.create("t.weight.f32", 1000, 16)
    directory.release()
    stat = (tmp_path / "rows" / "t.weight.f32").stat()
    assert stat.st_size == array.nbytes == 1000 * 16 * 4
    assert stat.st_blocks * 512 >= stat.st_size


def test_full_disk_is_a_clear_error_before_training(tmp_path, monkeypatch) -> None:
    def disk_full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", disk_full)
    rows = tmp_path / "rows"
    with pytest.raises(OSError, match=rf"host_storage {rows} has too little disk for (t_|split_tables_dim)[\w.]+\.f32: it needs [\d,]+ bytes, "
                       r"[\d,]+ are free.*larger disk") as raised:  # fmt: skip
        train(rows)
    assert raised.value.errno == errno.ENOSPC
    assert not list(rows.glob("*.f32"))  # the file that did not fit is not left behind


def test_file_size_limit_is_a_clear_error_and_leaves_no_file(tmp_path) -> None:
    # Issue 29 item 14: a raw "[Errno 27] File too large" from posix_fallocate and a 0-byte file left.
    probe = textwrap.dedent(f"""
        import resource
        from pathlib import Path
        from lightning_hotcache.cache import HostDirectory
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        directory = HostDirectory({str(tmp_path / "rows")!r})
        try:
            directory.create("t.weight.f32", 100_000, 16)
        except OSError as err:
            print(err.errno, err.strerror)
        print(sorted(p.name for p in Path({str(tmp_path / "rows")!r}).glob("*.f32")))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{errno.EFBIG} host_storage {tmp_path / 'rows'}: t.weight.f32 needs 6,400,000 bytes" in done.stdout
    assert "file-size limit, `ulimit -f`, is 65,536 bytes" in done.stdout
    assert done.stdout.strip().endswith("[]")


def test_read_only_host_storage_is_a_clear_error(tmp_path, monkeypatch) -> None:
    import lightning_hotcache.cache.host as host

    def read_only(path: Path, flags: int) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(host, "_open_no_symlink", read_only)
    with pytest.raises(OSError, match=rf"host_storage {tmp_path} is not writable \(Read-only file system\).*'memory'"):
        HostDirectory(tmp_path)


def test_host_storage_that_cannot_be_made_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "a_file").write_text("")  # a folder cannot be made inside a file
    path = tmp_path / "a_file" / "rows"
    with pytest.raises(OSError, match=rf"host_storage {path} cannot be made \(Not a directory\).*'memory'"):
        HostDirectory(path)


def test_filesystem_that_cannot_reserve_gets_a_sparse_file_and_a_warning(tmp_path, monkeypatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    directory = HostDirectory(tmp_path / "rows")
    with pytest.warns(UserWarning, match="cannot reserve space.*SIGBUS"):
        array = directory.create("t.weight.f32", 10, 4)
    directory.release()
    assert array.shape == (10, 4) and not array.any()


def test_host_storage_that_is_a_file_is_refused_early(tmp_path) -> None:
    file = tmp_path / "not_a_dir"
    file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        HotCacheStrategy(host_storage=str(file))
    with pytest.raises(NotADirectoryError, match="is a file"):
        HostDirectory(file)


def test_row_upload_off_cuda_gathers_the_rows_and_pins_nothing() -> None:
    """Off CUDA there is no copy to make asynchronous: rows are gathered as they are. (On CUDA,
    test_cuda.py checks the pinned buffers, the side stream and that the host never waits.)"""
    host = HostStore("t", 100, 4, {"momentum": 1})
    host.load("weight", torch.randn(100, 4))
    upload = RowUpload(torch.device("cpu"))
    ids = torch.tensor([5, 1, 5, 99])
    rows = upload.gather(host, ids)
    assert set(rows) == {"weight", "momentum"}
    torch.testing.assert_close(rows["weight"], host.weight[ids])
    assert upload.pinned_bytes() == 0 and not host.weight.is_pinned()


class _Transfer(Pipelineable):
    """A Pipelineable that records how it is moved (no CUDA needed to see the calls)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def pin_memory(self) -> "_Transfer":
        self.calls.append("pin_memory")
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> "_Transfer":
        self.calls.append(f"to {device} non_blocking={non_blocking}")
        return self

    def record_stream(self, stream: torch.Stream) -> None:
        pass


def test_staged_batches_go_to_cuda_from_pinned_memory_without_waiting() -> None:
    # Lightning's move copies a torchrec Batch with non_blocking=False, which on CUDA waits for
    # the stream's queued work (the step in flight, seen from the prefetch thread).
    calls: list[str] = []
    batch_to_device({"batch": _Transfer(calls), "other": [_Transfer(calls)], "name": "x"}, torch.device("cuda", 0))
    assert calls == ["pin_memory", "to cuda:0 non_blocking=True"] * 2


def test_staged_batches_of_other_types_move_as_lightning_moves_them() -> None:
    class Custom:  # has a `.to`, but is no tensor or torchrec type
        def __init__(self) -> None:
            self.moved_to: list[torch.device] = []

        def to(self, device: torch.device) -> "Custom":
            self.moved_to.append(device)
            return self

    custom = Custom()
    batch_to_device([custom, 3], torch.device("cuda", 0))
    assert custom.moved_to == [torch.device("cuda", 0)]


def test_staged_batches_move_to_the_cpu_as_lightning_moves_them() -> None:
    batch = tiny_synthetic().train_dataloader().__iter__().__next__()
    moved = batch_to_device(batch, torch.device("cpu"))
    assert torch.equal(moved.dense_features, batch.dense_features)
    assert torch.equal(moved.sparse_features.values(), batch.sparse_features.values())
