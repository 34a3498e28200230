"""Sharded checkpoints (``checkpoint_shards=True``): a kill at any point of a save leaves a
checkpoint that loads, a main file is never paired with the shards of another save, and a
checkpoint Lightning removes takes its shard files with it."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch
from conftest import cpu_trainer, flip_largest_tensor, tiny_synthetic
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins import AsyncCheckpointIO

from lightning_hotcache import HotCacheStrategy, progress
from lightning_hotcache.checkpoint import files as checkpoint_module
from lightning_hotcache.cache.exchange import RoundRobinRows
from lightning_hotcache.checkpoint.files import SHARDS_KEY, AtomicCheckpointIO, shard_contents, tensor_bytes, tensors_crc32, write_atomically
from lightning_hotcache.cli import main
from lightning_hotcache.embedding import hot_cold_modules
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY
from models import create_model


class _SaveAt(Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit(steps: int, callbacks: list[Callback], ckpt_path: Path | None = None, optimizer: str = "rowwise_adagrad") -> pl.Trainer:
    pl.seed_everything(0)
    # Tables of up to ~2k rows against a budget of a tenth of them: some are split, so there are shard files.
    dm = tiny_synthetic(scale=0.004, num_embeddings_cap=None, num_train_samples=8 * 64, batch_size=64)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": optimizer})
    strategy = HotCacheStrategy(device_budget=0.1, profile_batches=2, checkpoint_shards=True)
    trainer = cpu_trainer(
        strategy=strategy, max_steps=steps, limit_val_batches=0, enable_checkpointing=True, callbacks=callbacks
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pl.Trainer, Path]:
    """A trainer after 4 steps, and a folder with its checkpoints after step 2 (``a.ckpt``) and 4 (``b.ckpt``)."""
    folder = tmp_path_factory.mktemp("run")
    trainer = _fit(4, [_SaveAt(2, folder / "a.ckpt")])
    trainer.save_checkpoint(folder / "b.ckpt")
    return trainer, folder


def _copy(folder: Path, to: Path, prefix: str = "") -> Path:
    return Path(shutil.copytree(folder, to, ignore=lambda _, names: [n for n in names if not n.startswith(prefix)]))


def _content(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run takes from a checkpoint: its step, weights and row-wise optimizer
    state (a split table's arrays whole, where the strategy keeps them in the shards' pieces)."""

    def whole(tree: Any) -> Any:
        if isinstance(tree, RoundRobinRows):
            return tree.whole()
        return {key: whole(value) for key, value in tree.items()} if isinstance(tree, dict) else tree

    return {key: whole(checkpoint[key]) for key in ("global_step", "state_dict", ROW_STATE_KEY)}


def _consolidated(path: Path) -> dict[str, Any]:
    return main(["consolidate", str(path), "--out", str(path.parent.parent / "plain.ckpt")])


@contextlib.contextmanager
def _crash_images(folder: Path, into: Path) -> Iterator[list[Path]]:
    """Copies of ``folder`` as a kill at each point of the file operations run inside leaves
    it: before every torch.save, fsync, rename and unlink, and with each file that torch.save
    writes into ``folder`` half written (a kill in the middle of the write)."""
    images: list[Path] = []
    copying = False

    def image(half_written: Path | None = None) -> None:
        nonlocal copying
        if copying:
            return
        copying = True
        copy = Path(shutil.copytree(folder, into / str(len(images))))
        copying = False
        if half_written is not None:
            target = copy / half_written.name
            os.truncate(target, target.stat().st_size // 2)
        images.append(copy)

    def image_before(operation: Callable[..., Any]) -> Callable[..., Any]:
        def imaged(*args: Any, **kwargs: Any) -> Any:
            image()
            return operation(*args, **kwargs)

        return imaged

    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        image()
        real_save(obj, f, *args, **kwargs)
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        if isinstance(name, (str, os.PathLike)) and Path(name).resolve().parent == folder.resolve():
            if hasattr(f, "flush"):
                f.flush()
            image(half_written=Path(name))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", save)
        for name in ("fsync", "replace", "rename", "unlink", "remove"):
            patch.setattr(os, name, image_before(getattr(os, name)))
        yield images


def test_a_kill_at_any_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(run, tmp_path) -> None:
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    path = folder / "a.ckpt"
    load = trainer.strategy.load_checkpoint
    previous = _content(load(path))
    with _crash_images(folder, tmp_path / "images") as images:
        trainer.save_checkpoint(path)  # step 4 over step 2's checkpoint
    new = _content(load(path))
    assert (previous["global_step"], new["global_step"]) == (2, 4)

    found = []
    for image in images:
        for loaded in (_content(load(image / path.name)), _content(_consolidated(image / path.name))):
            expected = new if loaded["global_step"] == 4 else previous
            torch.testing.assert_close(loaded, expected, rtol=0, atol=0, msg=lambda m: f"kill image {image.name}: {m}")
        found.append(loaded["global_step"])
    assert found[0] == 2 and found[-1] == 4 and found == sorted(found), found  # the new save appears at one point

    # A later save to the same path clears what the kill left there (half-written files, old shards).
    for image in images:
        trainer.save_checkpoint(image / path.name)
        names = sorted(p.name for p in image.iterdir())
        assert len(names) == 2 and names[0] == path.name and names[1].endswith(".rank0-of-1"), (image.name, names)


def _replace_main_file(folder: Path) -> None:
    shutil.copy(folder / "b.ckpt", folder / "a.ckpt")  # step 4's main file beside step 2's shards


def _replace_shard_file(folder: Path) -> None:
    [a_shard], [b_shard] = folder.glob("a.ckpt.*rank0-of-1"), folder.glob("b.ckpt.*rank0-of-1")
    shutil.copy(b_shard, a_shard)  # step 4's shard under the name of step 2's


def _truncate_shard(size: Callable[[int], int]) -> Callable[[Path], None]:
    def truncate(folder: Path) -> None:
        [shard] = folder.glob("a.ckpt.*rank0-of-1")
        os.truncate(shard, size(shard.stat().st_size))

    return truncate


def _delete_shard(folder: Path) -> None:
    [shard] = folder.glob("a.ckpt.*rank0-of-1")
    shard.unlink()


def _shard(folder: Path) -> Path:
    [shard] = folder.glob("a.ckpt.*rank0-of-*")
    return shard


def _edit_main_file(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    checkpoint = torch.load(folder / "a.ckpt", weights_only=False)
    edit(checkpoint[SHARDS_KEY])
    torch.save(checkpoint, folder / "a.ckpt")


def _flip_table_bytes(folder: Path) -> None:
    """4 bytes inverted in the middle of the shard's largest tensor (a bad disk or copy):
    the file still loads, with other numbers."""
    flip_largest_tensor(_shard(folder))


def _flip_main_file_bytes(folder: Path) -> None:
    """As `_flip_table_bytes`, in the main file (its dense layers and tables wholly on the device)."""
    flip_largest_tensor(folder / "a.ckpt")


def _shard_copied_over_another_ranks(folder: Path) -> None:
    """As a 2-rank save whose rank 0 shard was also copied to rank 1's name (or the two swapped):
    with even row counts the rows fit, and went into the wrong tables' rows."""
    _edit_main_file(folder, lambda meta: meta.update(world_size=2))
    shard = torch.load(_shard(folder), weights_only=True)
    _shard(folder).unlink()
    as_rank0 = shard_contents(shard["id"], 0, 2, shard["tables"])
    for rank in (0, 1):
        torch.save(as_rank0, folder / f"a.ckpt.{shard['id']}.rank{rank}-of-2")


def _pickle_shard(folder: Path) -> None:
    shard = _shard(folder)
    shard.write_bytes(pickle.dumps(torch.load(shard, weights_only=True)))


def _foreign_torch_file_as_shard(folder: Path) -> None:
    torch.save({"weight": torch.ones(3)}, _shard(folder))


def _delete_one_of_two_shards(folder: Path) -> None:
    """As a 2-rank save whose rank 1 shard was deleted: rank 0's is there, of the same save."""
    _edit_main_file(folder, lambda meta: meta.update(world_size=2))
    shard = torch.load(_shard(folder), weights_only=True)
    _shard(folder).unlink()
    torch.save(shard_contents(shard["id"], 0, 2, shard["tables"]), folder / f"a.ckpt.{shard['id']}.rank0-of-2")


def _forge_save_id(folder: Path) -> None:
    _edit_main_file(folder, lambda meta: meta.update(id="../../outside"))


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (_replace_main_file, FileNotFoundError, r"a\.ckpt\.4-\w+\.rank0-of-1 is missing.*a\.ckpt\.2-\w+.*different saves"),
        (_replace_shard_file, ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 holds save 4-\w+.*different saves"),
        (_truncate_shard(lambda size: 0), ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 cannot be read"),
        (_truncate_shard(lambda size: size // 2), ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 cannot be read"),
        (_delete_shard, FileNotFoundError, r"a\.ckpt\.2-\w+\.rank0-of-1 is missing.*none of its shard files is there"),
        # Issue 23 items 9 and 10: each was read without a word, or reported as another fault.
        (_flip_table_bytes, ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 is corrupt: its tables do not match their checksum"),
        (_pickle_shard, ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 is not a hotcache shard file"),
        (_foreign_torch_file_as_shard, ValueError, r"a\.ckpt\.2-\w+\.rank0-of-1 is not a hotcache shard file"),
        (_delete_one_of_two_shards, FileNotFoundError,
         r"a\.ckpt\.2-\w+\.rank1-of-2 is missing.*other shard files \(a\.ckpt\.2-\w+\.rank0-of-2\) are there, so it was "
         "deleted or moved"),
        (_forge_save_id, ValueError, r"a\.ckpt is damaged or not a hotcache checkpoint: .* names save '\.\./\.\./outside'"),
        # Issue 29 items 3 and 4: both loaded without a word.
        (_shard_copied_over_another_ranks, ValueError,
         r"a\.ckpt\.2-\w+\.rank1-of-2 holds the shard of rank 0 of 2, not of rank 1 of 2 .*renamed or copied"),
        (_flip_main_file_bytes, ValueError, r"a\.ckpt is corrupt: the tensors it holds .* do not match their checksum"),
    ],
    ids=["main-of-another-save", "shard-of-another-save", "empty-shard", "truncated-shard", "missing-shard",
         "flipped-bytes", "pickled-shard", "foreign-shard", "one-of-two-shards-missing", "forged-save-id",
         "shard-under-another-ranks-name", "main-file-flipped-bytes"],
)  # fmt: skip
def test_a_main_file_without_its_own_whole_shards_is_a_clear_error(run, tmp_path, damage, error, message) -> None:
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run")
    damage(folder)
    with pytest.raises(error, match=message):
        trainer.strategy.load_checkpoint(folder / "a.ckpt")
    with pytest.raises(error, match=message):
        _consolidated(folder / "a.ckpt")


@pytest.mark.parametrize("save_last", [True, "link"])
def test_checkpoints_model_checkpoint_removes_take_their_shards(tmp_path, save_last) -> None:
    checkpoints = ModelCheckpoint(tmp_path, "{step}", save_top_k=1, every_n_train_steps=2, save_last=save_last)
    trainer = _fit(6, [checkpoints])
    names = {p.name for p in tmp_path.iterdir()}
    assert {"step=6.ckpt", "last.ckpt"} <= names
    # Nothing of step 2's or step 4's checkpoint is left: one shard file per checkpoint file (a link has none).
    assert {name.split(".ckpt")[0] for name in names} == {"step=6", "last"}, names
    assert len(names) == (4 if save_last is True else 3), names
    load = trainer.strategy.load_checkpoint
    torch.testing.assert_close(_content(load(tmp_path / "last.ckpt")), _content(load(tmp_path / "step=6.ckpt")))


def test_removing_a_checkpoint_removes_the_shards_of_every_rank(tmp_path) -> None:
    ours = ["x.ckpt", "x.ckpt.6-ab12.rank0-of-2", "x.ckpt.6-ab12.rank1-of-2", "x.ckpt.4-cd34.rank1-of-2"]
    crash_leftovers = ["x.ckpt.tmp-ef56", "x.ckpt.6-ab12.rank1-of-2.tmp-0a1b"]
    others = ["x.ckpt.v2.ckpt", "x.ckpt.v2.ckpt.6-ab12.rank0-of-1", "y.ckpt.6-ab12.rank0-of-2", "x.ckpt.notes"]
    for name in ours + crash_leftovers + others:
        (tmp_path / name).touch()
    HotCacheStrategy().remove_checkpoint(tmp_path / "x.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)


def test_checkpoints_are_synced_by_default_and_a_users_checkpoint_io_is_kept() -> None:
    assert isinstance(HotCacheStrategy().checkpoint_io, AtomicCheckpointIO)
    wrapping = HotCacheStrategy(checkpoint_io=AsyncCheckpointIO()).checkpoint_io
    assert isinstance(wrapping, AsyncCheckpointIO) and isinstance(wrapping.checkpoint_io, AtomicCheckpointIO)
    users = TorchCheckpointIO()
    assert HotCacheStrategy(checkpoint_io=users).checkpoint_io is users
    assert HotCacheStrategy(checkpoint_io=AsyncCheckpointIO(users)).checkpoint_io.checkpoint_io is users


def test_a_failed_write_leaves_the_previous_file_and_no_temporary_one(tmp_path, monkeypatch) -> None:
    path = tmp_path / "x.ckpt"
    write_atomically({"step": 1}, path)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomically({"step": 2}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]
    assert torch.load(path) == {"step": 1}


@pytest.mark.parametrize("before", ["shard-checksums", "ranks-in-shards"])
def test_a_save_from_before_shard_checksums_still_loads(run, tmp_path, before: str) -> None:
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    expected = _content(trainer.strategy.load_checkpoint(folder / "a.ckpt"))
    shard = torch.load(_shard(folder), weights_only=True)
    del shard["rank"], shard["world_size"]
    if before == "shard-checksums":
        _edit_main_file(folder, lambda meta: (meta.pop("crc32"), meta.pop("main_crc32")))
        del shard["crc32"]
    else:  # checksums of the shard's tables alone, none of the main file
        _edit_main_file(folder, lambda meta: meta.pop("main_crc32"))
        shard["crc32"] = tensors_crc32(shard["tables"])
    torch.save(shard, _shard(folder))
    torch.testing.assert_close(_content(trainer.strategy.load_checkpoint(folder / "a.ckpt")), expected, rtol=0, atol=0)


def test_resuming_copies_split_tables_from_the_mapped_shards_never_whole(run, tmp_path, monkeypatch) -> None:
    # The path for tables larger than memory: each rank copies its rows of a split table from
    # the memory-mapped shard files piece by piece into its tiers; no table is made whole.
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    expected = _content(_consolidated(folder / "a.ckpt"))
    real_load, shard_loads = torch.load, []

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and ".rank" in Path(f).name:  # Lightning opens the main file itself
            shard_loads.append(kwargs.get("mmap"))
        return real_load(f, *args, **kwargs)

    def refuse(self: RoundRobinRows) -> torch.Tensor:
        raise AssertionError("a split table was made whole to be loaded")

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(RoundRobinRows, "whole", refuse)
    resumed = _fit(2, [], ckpt_path=folder / "a.ckpt")  # restored at step 2, nothing more to train
    assert shard_loads == [True]  # one rank's shard, memory-mapped
    monkeypatch.undo()
    model = resumed.lightning_module
    assert resumed.global_step == 2
    split = [name for module in hot_cold_modules(model).values() for name, cache in module.caches.items() if not cache.identity]
    assert split  # the plan splits tables: their rows came from the shards
    torch.testing.assert_close(model.state_dict(), expected["state_dict"], rtol=0, atol=0)
    state = {f"{path}.{name}": arrays for path, module in hot_cold_modules(model).items() for name, arrays in module.optimizer_state().items()}
    torch.testing.assert_close(state, expected[ROW_STATE_KEY], rtol=0, atol=0)


def test_a_checksum_read_chunk_by_chunk_is_the_one_of_the_whole(monkeypatch) -> None:
    # Checkpoints saved before the chunks (one CRC call a tensor) must still match.
    tables = {"t": {"weight": torch.randn(1000, 8), "momentum": torch.randn(1000, 1)}, "u": {"weight": torch.empty(0, 8)}}
    expected = 7
    for key in ("t", "u"):
        for name, tensor in sorted(tables[key].items()):
            expected = zlib.crc32(f"{key}/{name}/{tuple(tensor.shape)}/{tensor.dtype}".encode(), expected)
            expected = zlib.crc32(tensor.numpy().tobytes(), expected)
    monkeypatch.setattr(checkpoint_module, "CHUNK_BYTES", 1000)  # 33 chunks of the first weight
    read: list[int] = []
    assert tensors_crc32(tables, 7, progress=read.append) == expected
    assert sum(read) == tensor_bytes(tables) == 1000 * 9 * 4 and len(read) > 3


def test_resuming_large_tables_shows_the_bytes_checked_and_restored(run, tmp_path, monkeypatch, capsys) -> None:
    # A restore of many GB runs for minutes: a bar for each shard's checksum (the bytes read
    # from disk), for the tables and for their row-wise state (every byte this process
    # writes), each counting to its total, on stderr.
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    bars: list[progress.tqdm] = []

    class Recorded(progress.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(progress, "tqdm", Recorded)
    monkeypatch.setattr(progress, "PROGRESS_FROM_BYTES", 1)
    _fit(2, [], ckpt_path=folder / "a.ckpt")
    restored = {bar.desc: (bar.n, bar.total) for bar in bars if bar.desc.startswith(("loading", "checking"))}
    shard = next(folder.glob("a.ckpt*rank*")).name
    assert set(restored) == {f"checking {shard}", "loading tables", "loading row-wise state"}
    assert all(n == total > 0 for n, total in restored.values())
    err = capsys.readouterr().err
    assert all(desc in err for desc in restored)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resuming_with_another_embedding_optimizer_is_a_clear_error(run, tmp_path, optimizer: str) -> None:
    # Saved with row-wise Adagrad: its momentum cannot become Adam's moments, nor be dropped in
    # silence (the rows would step differently than the run that saved them).
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    with pytest.raises(ValueError, match=rf"state has \['momentum'\], but this model's {optimizer} keeps .*another embedding optimizer"):
        _fit(2, [], ckpt_path=folder / "a.ckpt", optimizer=optimizer)


def test_a_shard_with_rows_missing_is_a_clear_error(run, tmp_path) -> None:
    # Checksummed as written (a tool that rewrote it), but short of rows: named, not interleaved wrong.
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    shard = torch.load(_shard(folder), weights_only=True)
    table = next(iter(shard["tables"]))
    shard["tables"][table]["weight"] = shard["tables"][table]["weight"][:-1]
    torch.save(shard_contents(shard["id"], 0, shard["world_size"], shard["tables"]), _shard(folder))
    with pytest.raises(ValueError, match=rf"rank0-of-1 holds \d+ rows of {table}\.weight, but rank 0 of 1 holds \d+"):
        trainer.strategy.load_checkpoint(folder / "a.ckpt")


def test_a_sharded_checkpoint_under_another_strategy_says_to_consolidate(run, tmp_path) -> None:
    # Issue 23 item 10: before, a bare "Missing key(s) in state_dict" for the split tables.
    _, saved = run
    dm = tiny_synthetic(scale=0.004, num_embeddings_cap=None, num_train_samples=8 * 64, batch_size=64)
    model = create_model("dlrm", dm.tables, dm.num_dense_features, embedding_optimizer={"name": "rowwise_adagrad"})
    trainer = cpu_trainer(strategy="auto", max_steps=6, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"checkpoint_shards=True.*`hotcache consolidate <checkpoint> --out plain\.ckpt`"):
        trainer.fit(model, dm, ckpt_path=saved / "a.ckpt")


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        ("folder", IsADirectoryError, r"cannot save the plain checkpoint as .*folder: it is a folder"),
        ("", ValueError, "the output path for the plain checkpoint is empty"),
    ],
)
def test_consolidate_into_a_folder_or_nowhere_says_so_before_loading(run, tmp_path, monkeypatch, out, error, message) -> None:
    # Issue 29 item 15: a folder failed after the whole load, naming a hidden temporary file.
    import lightning_hotcache.checkpoint.files as checkpoint_module

    _, saved = run
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(checkpoint_module, "_load_main_file", lambda path: pytest.fail("loaded first"))
    with pytest.raises(error, match=message):
        main(["consolidate", str(saved / "a.ckpt"), "--out", out])


@pytest.mark.parametrize("target", ["main", "shard"])
def test_consolidate_onto_its_own_input_is_refused_and_leaves_it_whole(run, target, tmp_path) -> None:
    # Issue 69 item 11: --out equal to the main file or a shard succeeded and overwrote it.
    _, saved = run
    main_file = saved / "a.ckpt"
    out = main_file if target == "main" else next(saved.glob("a.ckpt.*.rank0-of-*"))
    before = out.read_bytes()
    with pytest.raises(ValueError, match=r"would overwrite its input"):
        main(["consolidate", str(main_file), "--out", str(out)])
    assert out.read_bytes() == before
    main(["consolidate", str(main_file), "--out", str(tmp_path / "plain.ckpt")])  # still a whole checkpoint


@pytest.mark.parametrize("content", [b"step,loss\n1,0.5\n", b""], ids=["text", "empty"])
def test_consolidate_of_a_file_that_is_no_checkpoint_says_so(tmp_path, content: bytes) -> None:
    # Issue 29 item 15: a text file ended in "KeyError: 101".
    (tmp_path / "notes.ckpt").write_bytes(content)
    with pytest.raises(ValueError, match=r"notes\.ckpt is not a checkpoint \(torch\.save's format"):
        main(["consolidate", str(tmp_path / "notes.ckpt"), "--out", str(tmp_path / "plain.ckpt")])


def _shard_made_a_folder(folder: Path) -> None:
    shard = _shard(folder)
    shard.unlink()
    shard.mkdir()


def _shard_made_a_dangling_link(folder: Path) -> None:
    shard = _shard(folder)
    shard.unlink()
    shard.symlink_to(folder / "gone")


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (_shard_made_a_folder, ValueError, r"rank0-of-1 is a folder \(or another non-file\), not a hotcache shard file"),
        (_shard_made_a_dangling_link, FileNotFoundError, r"rank0-of-1 is a link to .*gone, which does not exist"),
    ],
    ids=["folder", "dangling-link"],
)
def test_a_shard_that_is_no_file_is_named_as_such(run, tmp_path, damage, error, message) -> None:
    # Issue 29 item 15: both were reported "missing" while listed among the files present.
    trainer, saved = run
    folder = _copy(saved, tmp_path / "run", prefix="a.ckpt")
    damage(folder)
    with pytest.raises(error, match=message):
        trainer.strategy.load_checkpoint(folder / "a.ckpt")


def test_consolidate_into_a_missing_folder_says_so(run, tmp_path) -> None:
    # Issue 23 item 10: before, a FileNotFoundError naming a hidden temporary file, after the whole load.
    _, saved = run
    out = tmp_path / "missing" / "plain.ckpt"
    with pytest.raises(FileNotFoundError, match=f"cannot save {out}: the output folder {out.parent} does not exist"):
        main(["consolidate", str(saved / "a.ckpt"), "--out", str(out)])


def test_a_disk_that_fills_up_mid_save_is_said_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    # Issue 69 item 6: torch's "[enforce fail at inline_container.cc:672] unexpected pos ..." on a full disk.
    import shutil
    from collections import namedtuple

    import lightning_hotcache.checkpoint.files as files

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(10)}, path)
    before = path.read_bytes()

    def disk_full(obj, f) -> None:
        f.write(b"PK partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 12")

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(files.torch, "save", disk_full)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(OSError, match=rf"no space left on {tmp_path} to save last.ckpt: it needs about 3.9 KiB and 100 B are free"):
        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(1000)}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left
