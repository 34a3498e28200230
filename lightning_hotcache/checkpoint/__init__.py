"""Checkpoint files: atomic writes, sharded checkpoints (one file per rank) and their
consolidation into a plain checkpoint (`files`). Its public names are re-exported here."""

from lightning_hotcache.checkpoint.files import (
    SHARDS_KEY,
    AtomicCheckpointIO,
    check_output_file,
    consolidate_checkpoint,
    write_file_atomically,
)

__all__ = ["SHARDS_KEY", "AtomicCheckpointIO", "check_output_file", "consolidate_checkpoint", "write_file_atomically"]
