"""`python -m lightning_hotcache` is the `hotcache` console script."""

from lightning_hotcache.cli import entry_point

if __name__ == "__main__":
    entry_point()
