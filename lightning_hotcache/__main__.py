"""`python -m lightning_hotcache` is the `hotcache` console script."""

from lightning_hotcache.cli import main

if __name__ == "__main__":
    main()
