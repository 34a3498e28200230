"""Sharded checkpoint files (``HotCacheStrategy(checkpoint_shards=True)``), written so that a
kill at any moment of a save leaves a checkpoint that loads: the previous one or the new one.

A sharded checkpoint is the main file ``<ckpt>`` (rank 0's) and one shard file per rank,
``<ckpt>.<id>.rank<r>-of-<n>``. The id (global step + a random token, one for all ranks)
is recorded in the main file and in every shard, so a main file only ever pairs with the
shards of its own save. Every file is written under a temporary name, synced, and renamed
over its target, so a file under its final name is always whole. A save writes the shards
first, then, once every rank's are in place, the main file; only then are the previous
save's shards of that path removed: until the new main file replaces the old one, the old
one's shards are still there under their own names. Every shard carries a CRC-32 of its
tables, its rank and the number of ranks (so a shard renamed or copied to another rank's
name is refused, not loaded into the wrong rows), and the main file's record a CRC-32 of the
main file's own tensors; both are checked when read: torch's loader checks no data, and a
flipped bit would otherwise be trained on or consolidated without a word.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import secrets
import shutil
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_hotcache.cache.exchange import RoundRobinRows
from lightning_hotcache.cache.host import CHUNK_BYTES
from lightning_hotcache._ops.progress import Progress, byte_bar
from lightning_hotcache.optim.rowwise import ROW_STATE_KEY
from lightning_hotcache.planner.plan import format_bytes

SHARDS_KEY = "hotcache_shards"
# What `new_save_id` makes. A main file's id becomes part of its shards' file names, so one
# that does not match (a damaged or forged file) must not be used to build a path.
SAVE_ID = re.compile(r"\d+-[0-9a-f]+")
# torch.save's format (a zip archive): a shard file that does not start with it was not written by hotcache.
ZIP_MAGIC = b"PK\x03\x04"


def new_save_id(step: int) -> str:
    return f"{step}-{secrets.token_hex(4)}"


def tensors_crc32(tree: Any, crc: int = 0, path: str = "", progress: Progress | None = None) -> int:
    """CRC-32 (continuing ``crc``) of every tensor in ``tree`` (nested dicts, lists, tuples): its
    path of keys, shape, dtype and every byte of data. Other leaves are not covered (their
    reprs need not be stable); a shard's tables are ``{table: {array: tensor}}``. ``progress``
    is told the bytes of data as they are read (`tensor_bytes` in all), chunk by chunk: the
    tensors of a memory-mapped shard are read from disk here."""
    if isinstance(tree, torch.Tensor):
        tensor = tree.detach().cpu().contiguous()
        crc = zlib.crc32(f"{path}/{tuple(tensor.shape)}/{tensor.dtype}".encode(), crc)
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        for start in range(0, len(data), CHUNK_BYTES):  # the CRC of the whole, continued chunk to chunk
            chunk = data[start : start + CHUNK_BYTES]
            crc = zlib.crc32(chunk, crc)
            if progress is not None:
                progress(len(chunk))
        return crc
    for key, value in _items(tree):
        crc = tensors_crc32(value, crc, f"{path}/{key}" if path else str(key), progress)
    return crc


def tensor_bytes(tree: Any) -> int:
    """Bytes of data of every tensor in ``tree`` (as `tensors_crc32` walks it)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return sum(tensor_bytes(value) for _, value in _items(tree))


def _items(tree: Any) -> Iterable[tuple[Any, Any]]:
    """The children of a dict (in key order), list or tuple; none of another leaf."""
    if isinstance(tree, Mapping):
        return sorted(tree.items(), key=lambda kv: str(kv[0]))
    return enumerate(tree) if isinstance(tree, (list, tuple)) else ()


def _shard_identity_crc32(save_id: str, rank: int, world: int) -> int:
    return zlib.crc32(f"{save_id}/rank{rank}-of-{world}".encode())


def shard_contents(save_id: str, rank: int, world: int, tables: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """What one rank's shard file holds: its save's id, whose shard it is, its tables, and one
    checksum over all of them."""
    crc = tensors_crc32(tables, _shard_identity_crc32(save_id, rank, world))
    return {"id": save_id, "rank": rank, "world_size": world, "tables": tables, "crc32": crc}


def main_file_crc32(checkpoint: Mapping[str, Any]) -> int:
    """CRC-32 of every tensor a sharded checkpoint's main file holds itself (the state dict,
    row-wise and dense optimizer state, ...), its shard record left out (it holds this)."""
    return tensors_crc32({k: v for k, v in checkpoint.items() if k != SHARDS_KEY})


def shard_path(checkpoint_path: _PATH, save_id: str, rank: int, world: int) -> Path:
    return Path(f"{checkpoint_path}.{save_id}.rank{rank}-of-{world}")


def write_atomically(obj: Any, path: _PATH) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds the previous file or the whole new one,
    also after a kill or a power loss. A disk that fills up mid-write is said as such (torch
    reports it as its zip writer's "unexpected pos"), with the bytes needed and free."""
    path = Path(path)
    try:
        write_file_atomically(path, lambda f: torch.save(obj, f))
    except (OSError, RuntimeError) as err:
        if not _out_of_space(err):
            raise
        needs, free = tensor_bytes(obj), shutil.disk_usage(path.parent).free
        if free >= needs:
            raise
        raise OSError(
            errno.ENOSPC,
            f"no space left on {path.parent} to save {path.name}: it needs about {format_bytes(needs)} and "
            f"{format_bytes(free)} are free. Free space there or save elsewhere; the previous file at {path} is kept.",
        ) from err


def _out_of_space(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return any(sign in str(err) for sign in ("unexpected pos", "No space left", "failed writing"))


def write_file_atomically(path: _PATH, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` into a new file that then replaces ``path``, synced: ``path`` holds the previous
    file or the whole new one, also after a kill or a power loss."""
    path = Path(path)
    temp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(temp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the folder is synced.
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO, writing local checkpoint files with `write_atomically`
    (Lightning renames a temporary file too, but syncs nothing: a power loss can leave the
    new name with no data after the previous save's shards are gone)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        fs, local_path = url_to_fs(str(path))
        if storage_options is not None or not isinstance(fs, LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # remote: fsspec's transaction
            return
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(checkpoint, local_path)


def _own_files(checkpoint_path: _PATH) -> list[tuple[Path, str | None]]:
    """The shard files of the checkpoint at ``checkpoint_path`` (with their save ids) and the
    temporary files a killed save of it left (id None)."""
    path = Path(checkpoint_path)
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"{re.escape(path.name)}(?:\.({SAVE_ID.pattern})\.rank\d+-of-\d+)?(\.tmp-[0-9a-f]+)?")
    found = []
    with os.scandir(path.parent) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match and (match[1] or match[2]):
                found.append((Path(entry.path), None if match[2] else match[1]))
    return found


def remove_shards(checkpoint_path: _PATH, keep: str | None = None) -> None:
    """Remove the shard files of every rank of the checkpoint at ``checkpoint_path`` (but those
    of save ``keep``) and what a killed save of it left. The caller is one process (rank 0)."""
    for file, save_id in _own_files(checkpoint_path):
        if save_id is None or save_id != keep:
            file.unlink(missing_ok=True)


def check_output_file(out: _PATH, what: str) -> None:
    """Refuse an output path that cannot take a file, before the work that makes the file (and
    since a failed write's own error names a hidden temporary file)."""
    if not str(out).strip():
        raise ValueError(f"the output path for the {what} is empty; give a file name, e.g. {what.replace(' ', '_')}.out")
    if Path(out).is_dir():
        raise IsADirectoryError(f"cannot save the {what} as {out}: it is a folder; give a file path, e.g. {Path(out) / 'out'}.")
    if not Path(out).parent.is_dir():
        raise FileNotFoundError(f"cannot save {out}: the output folder {Path(out).parent} does not exist; create it first.")


def _load_main_file(path: _PATH) -> dict[str, Any]:
    """A checkpoint's main file, or an error saying it is none."""
    not_ours = f"{path} is not a checkpoint (torch.save's format, as Lightning writes them); give a checkpoint's main file."
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file; give a checkpoint's main file.")
    with open(path, "rb") as f:
        if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
            raise ValueError(not_ours)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError) as err:
        raise ValueError(f"{not_ours} ({type(err).__name__}: {err})") from err
    if not isinstance(checkpoint, dict):
        raise ValueError(not_ours)
    return checkpoint


def consolidate_checkpoint(path: _PATH, out: _PATH | None = None) -> dict[str, Any]:
    """A plain checkpoint from one saved with ``checkpoint_shards=True``: the shard files of
    every rank are interleaved back into whole tables (state_dict) and row state. Needs the
    whole tables in memory. Saves to ``out`` when given."""
    if out is not None:
        check_output_file(out, "plain checkpoint")
        _refuse_overwriting_the_input(path, out)
    checkpoint = consolidated(_load_main_file(path), path)
    if out is not None:
        write_atomically(checkpoint, out)
    return checkpoint


def _refuse_overwriting_the_input(path: _PATH, out: _PATH) -> None:
    """``out`` must be neither the sharded checkpoint's main file nor one of its shard files:
    writing there would replace what is being read, and a failure midway would lose both."""
    main, target = Path(path).resolve(), Path(out).resolve()
    is_shard = target.parent == main.parent and target.name.startswith(f"{main.name}.") and ".rank" in target.name
    if target == main or is_shard:
        raise ValueError(
            f"--out {out} is {'the checkpoint being consolidated' if target == main else 'one of its shard files'}: "
            "writing the plain checkpoint there would overwrite its input. Give another path."
        )


def check_not_sharded(checkpoint: dict[str, Any]) -> None:
    """Refuse a ``checkpoint_shards`` checkpoint that reached a model without its shard files
    merged in (any strategy but ``hotcache`` loads the main file alone): its split tables would
    surface as a bare ``Missing key(s)`` that names neither cause nor fix."""
    meta = checkpoint.get(SHARDS_KEY)
    if meta is not None:
        raise ValueError(
            f"This checkpoint was saved with HotCacheStrategy(checkpoint_shards=True) by {meta.get('world_size')} "
            "rank(s): its split tables are in per-rank shard files beside it, which only the hotcache strategies "
            "read. Resume it with a hotcache strategy, or make a plain checkpoint of it for any strategy: "
            "`hotcache consolidate <checkpoint> --out plain.ckpt`."
        )


def consolidated(
    checkpoint: dict[str, Any],
    path: _PATH,
    in_pieces: bool = False,
    checks: Callable[[int], bool] | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """``checkpoint`` (the main file at ``path``, already loaded) with its shard files merged
    in: each split table's arrays whole, or with ``in_pieces`` as the shards hold them
    (`RoundRobinRows` of the memory-mapped shard files, which the hotcache strategy loads piece
    by piece into each rank's tiers: no table whole in memory, and each rank's own rows read
    from disk as they are copied). ``checks(rank)``: whether to verify the checksum of that
    rank's shard here (default: every shard; the strategy splits them across its ranks), with a
    bar of the bytes read where a shard is large, unless not ``show_progress``."""
    meta = checkpoint.pop(SHARDS_KEY, None)
    if meta is None:
        raise ValueError(f"{path} is not a sharded hotcache checkpoint (it has no {SHARDS_KEY!r}).")
    if "id" not in meta:
        raise ValueError(
            f"{path} was saved by an older lightning-hotcache, whose shard files cannot be told from those of "
            "another save; load it with that version and save it again, or use another checkpoint."
        )
    save_id, world = meta["id"], meta.get("world_size")
    if not (isinstance(save_id, str) and SAVE_ID.fullmatch(save_id) and isinstance(world, int) and world >= 1):
        raise ValueError(
            f"{path} is damaged or not a hotcache checkpoint: its shard record names save {save_id!r} of "
            f"{world!r} rank(s), where hotcache writes '<step>-<hex>' and a number of ranks. Use another checkpoint."
        )
    # A link (ModelCheckpoint(save_last="link")) has its target's shards.
    main_file = Path(os.path.realpath(path))
    # Saves from before the main file's checksum have none to check.
    if "main_crc32" in meta and meta["main_crc32"] != main_file_crc32(checkpoint):
        raise ValueError(
            f"{main_file} is corrupt: the tensors it holds (dense layers, tables wholly on the device, optimizer "
            "state) do not match their checksum (bytes changed on disk or in transfer since the save). Use another "
            "checkpoint, or a copy of this file from where it was written."
        )
    # Saves from before shard checksums have none to check (their main file does not ask for them).
    checksummed = bool(meta.get("crc32"))
    shards = [
        _load_shard(main_file, save_id, rank, world, checksummed and (checks is None or checks(rank)), show_progress)
        for rank in range(world)
    ]
    row_state = checkpoint.setdefault(ROW_STATE_KEY, {})
    for key, rows in meta["num_embeddings"].items():
        arrays: dict[str, Any] = {}
        for name in shards[0][key]:
            pieces = tuple(shard[key][name] for shard in shards)
            for rank, piece in enumerate(pieces):
                if len(piece) != len(range(rank, rows, world)):
                    raise ValueError(
                        f"{shard_path(main_file, save_id, rank, world)} holds {len(piece)} rows of {key}.{name}, but rank "
                        f"{rank} of {world} holds {len(range(rank, rows, world))} of its {rows}: the shard files do not "
                        "belong to this checkpoint. Use another checkpoint."
                    )
            arrays[name] = RoundRobinRows(pieces) if in_pieces else RoundRobinRows(pieces).whole()
        module_path, table = key.rsplit(".", 1)
        checkpoint["state_dict"][f"{module_path}.embedding_bags.{table}.weight"] = arrays.pop("weight")
        row_state[key] = arrays
    return checkpoint


def _load_shard(main_file: Path, save_id: str, rank: int, world: int, checksummed: bool, show_progress: bool) -> dict[str, Any]:
    file = shard_path(main_file, save_id, rank, world)
    if file.is_symlink() and not file.exists():
        raise FileNotFoundError(
            f"{file} is a link to {os.readlink(file)}, which does not exist: the checkpoint {main_file} (save "
            f"{save_id}) needs rank {rank}'s shard there. Put the shard file back, or use another checkpoint."
        )
    if file.exists() and not file.is_file():
        raise ValueError(
            f"{file} is a folder (or another non-file), not a hotcache shard file: the checkpoint {main_file} (save "
            f"{save_id}) needs rank {rank}'s shard there. Put the shard file back, or use another checkpoint."
        )
    if not file.is_file():
        found = _own_files(main_file)
        same_save = sorted(other.name for other, other_id in found if other_id == save_id)
        other_saves = sorted(other.name for other, other_id in found if other_id not in (None, save_id))
        if other_saves:
            why = f"beside it are {', '.join(other_saves)}: {main_file.name} and its shard files are from different saves"
        elif same_save:
            why = f"the save's other shard files ({', '.join(same_save)}) are there, so it was deleted or moved"
        else:
            why = "none of its shard files is there (deleted or moved, or the main file was copied without them)"
        raise FileNotFoundError(
            f"{file} is missing: the checkpoint {main_file} (save {save_id}) needs the shard files of all its "
            f"{world} rank(s); {why}. Put it back, or use another checkpoint."
        )
    not_ours = (
        f"{file} is not a hotcache shard file (hotcache writes torch.save archives of a save id, tables and their "
        f"checksum); the checkpoint {main_file} needs its own shard of rank {rank} there. Use another checkpoint."
    )
    with open(file, "rb") as f:
        magic = f.read(len(ZIP_MAGIC))
    if magic and magic != ZIP_MAGIC:  # empty: a truncated write, reported below
        raise ValueError(not_ours)
    try:
        # Memory-mapped: a shard's rows are read from the file as they are copied, not all at once.
        shard = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:  # objects other than tensors, or a damaged pickle
        raise ValueError(f"{not_ours} It holds objects other than tensors, or is corrupt.") from err
    except (EOFError, RuntimeError) as err:  # torch's names neither the file nor what to do
        raise ValueError(
            f"{file} cannot be read (truncated or corrupt: {err}); the checkpoint {main_file} needs it. "
            "Use another checkpoint."
        ) from err
    if not (isinstance(shard, dict) and "id" in shard and isinstance(shard.get("tables"), dict)):
        raise ValueError(not_ours)
    if shard["id"] != save_id:
        raise ValueError(
            f"{file} holds save {shard['id']}, but {main_file} is save {save_id}: the main file and the shard "
            "files are from different saves. Use another checkpoint."
        )
    if "rank" in shard and (shard["rank"], shard.get("world_size")) != (rank, world):
        raise ValueError(
            f"{file} holds the shard of rank {shard['rank']} of {shard.get('world_size')}, not of rank {rank} of "
            f"{world} as its name says: shard files were renamed or copied over one another, and would load into "
            "the wrong rows. Put each rank's file back under its own name, or use another checkpoint."
        )
    # Shards from before ranks were recorded have a checksum of their tables alone.
    identity = _shard_identity_crc32(save_id, rank, world) if "rank" in shard else 0
    if not checksummed:
        return shard["tables"]
    # Memory-mapped: checking a shard reads it from disk, a minute for tens of GB.
    with byte_bar(tensor_bytes(shard["tables"]), f"checking {file.name}", show=show_progress) as bar:
        crc = tensors_crc32(shard["tables"], identity, progress=bar.update)
    if shard.get("crc32") != crc:
        raise ValueError(
            f"{file} is corrupt: its tables do not match their checksum (bytes changed on disk or in transfer since "
            f"the save); the checkpoint {main_file} needs it. Use another checkpoint, or a copy of this file from "
            "where it was written."
        )
    return shard["tables"]
