"""`hotcache` console script: LightningCLI for any CTR model and datamodule.

    hotcache fit -c configs/dlrm_synthetic.yaml
    hotcache fit --model models.DeepFM --data datamodules.SyntheticCTRDataModule --trainer.max_epochs 1
    hotcache profile -c configs/dlrm_synthetic.yaml --out stats.npz --plot coverage.png
    hotcache plan -c configs/dlrm_synthetic.yaml --budget 2GB [--stats stats.npz] [--out plan.json]
    hotcache consolidate checkpoints/run/last.ckpt --out plain.ckpt   # from checkpoint_shards=True

Model and data are given by class path (subclass mode), so user subclasses work too. The
datamodule's ``tables`` and ``num_dense_features`` are linked into the model, so a config
never repeats table sizes. After ``fit`` the final validation metrics are printed as a
table, with the data's Bayes-optimal figures beside them when it knows them.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI, LightningArgumentParser
from rich.console import Console
from rich.table import Table
from typing_extensions import override


class HotCacheCLI(LightningCLI):
    """LightningCLI with the datamodule's table shapes linked into the model."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.tables", "model.init_args.tables", apply_on="instantiate")
        parser.link_arguments("data.num_dense_features", "model.init_args.num_dense_features", apply_on="instantiate")

    def _print_metrics(self, stage: str) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(f"{stage}/")}
        if not metrics:
            return
        table = Table(title=f"{stage} metrics")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name in sorted(metrics):
            table.add_row(name, f"{metrics[name]:.4f}")
        bayes = metrics.get(f"{stage}/bayes_auc")
        if bayes is not None and f"{stage}/auc" in metrics:
            table.add_row("AUC gap to Bayes-optimal", f"{bayes - metrics[f'{stage}/auc']:.4f}")
        Console().print(table)

    def after_fit(self) -> None:
        # `validate` and `test` print Lightning's own table; `fit` prints none.
        self._print_metrics("val")


def _lightning_cli(args: Any, run: bool = True) -> HotCacheCLI:
    return HotCacheCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def model_tables(model: torch.nn.Module) -> list:
    """Every table of every torchrec EmbeddingBagCollection in ``model``, at any depth."""
    from torchrec import EmbeddingBagCollection

    return [t for m in model.modules() if isinstance(m, EmbeddingBagCollection) for t in m.embedding_bag_configs()]


def _tool_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"hotcache {command}",
        description="Model and data come from a LightningCLI config (-c) plus any --model/--data/--trainer overrides.",
    )
    parser.add_argument("--batches", type=int, default=200, help="training batches to profile (default 200)")
    if command == "profile":
        parser.description = "Count row accesses of the training data; save them as .npz. " + parser.description
        parser.add_argument("--out", required=True, help="where to write the stats (.npz)")
        parser.add_argument("--plot", help="also save the coverage curves as an image (e.g. coverage.png)")
    else:
        parser.description = "Print (and save) the hot/cold plan for a device budget. " + parser.description
        parser.add_argument("--budget", required=True, help="bytes, '2GB', a fraction in (0, 1] of the tables, or 'auto'")
        parser.add_argument("--stats", help="access stats from `hotcache profile` (profiled on the fly if absent)")
        parser.add_argument("--out", help="save the plan as JSON here")
        parser.add_argument("--prefetch-depth", type=int, default=1)
        parser.add_argument("--world-size", type=int, default=1)
        parser.add_argument("--policy", choices=["lfu", "lru", "static"], default="lfu")
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser


def _profile(cli: HotCacheCLI, tables: list, batches: int) -> Any:
    from lightning_hotcache.profiling import profile_batches

    cli.datamodule.setup("fit")
    return profile_batches(cli.datamodule.train_dataloader(), tables, max_batches=batches)


def run_tool(command: str, argv: Sequence[str]) -> Any:
    """``hotcache profile`` / ``hotcache plan``: model and data from the config, no training."""
    from lightning_hotcache.planner import Budget, HotColdPlanner
    from lightning_hotcache.profiling import AccessStats, plot_coverage
    from lightning_hotcache.rowwise import RowWiseOptimizerConfig

    options, rest = _tool_parser(command).parse_known_args(argv)
    with warnings.catch_warnings():
        # We hand LightningCLI the config part of our own command line on purpose.
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        cli = _lightning_cli(list(rest), run=False)
    tables = model_tables(cli.model)
    if not tables:
        raise SystemExit(f"{type(cli.model).__name__} has no torchrec EmbeddingBagCollection: nothing to profile or plan.")
    if command == "profile":
        stats = _profile(cli, tables, options.batches)
        stats.save(options.out)
        print(stats.summary())
        print(f"saved {options.out}")
        if options.plot:
            plot_coverage(stats, options.plot)
            print(f"saved {options.plot}")
        return stats
    stats = AccessStats.load(options.stats, tables) if options.stats else None
    budget: Budget = options.budget
    optimizer = getattr(cli.model, "embedding_optimizer_config", None) or RowWiseOptimizerConfig()
    planner = HotColdPlanner(budget, optimizer, options.world_size, options.prefetch_depth, options.policy, options.device)
    try:
        plan = planner.plan(tables, stats)
    except ValueError as err:
        if stats is not None or "hotcache profile" not in str(err):
            raise SystemExit(f"error: {err}") from None
        plan = planner.plan(tables, _profile(cli, tables, options.batches))
    print(plan)
    if options.out:
        plan.save(options.out)
        print(f"saved {options.out}")
    return plan


def _consolidate(argv: Sequence[str]) -> dict[str, Any]:
    from lightning_hotcache.strategy import consolidate_checkpoint

    parser = argparse.ArgumentParser(
        prog="hotcache consolidate",
        description="Turn a checkpoint saved with checkpoint_shards=True into a plain one (whole tables).",
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--out", required=True, help="where to write the plain checkpoint")
    options = parser.parse_args(argv)
    checkpoint = consolidate_checkpoint(options.checkpoint, options.out)
    print(f"saved {options.out}")
    return checkpoint


def main(args: Any = None) -> Any:
    """Entry point of the ``hotcache`` script (``args`` as for LightningCLI, for tests)."""
    # W&B never reaches the network unless the user asks for it (configs use offline mode too).
    os.environ.setdefault("WANDB_MODE", "offline")
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in ("profile", "plan"):
        return run_tool(argv[0], argv[1:])
    if argv and argv[0] == "consolidate":
        return _consolidate(argv[1:])
    return _lightning_cli(args)


def entry_point() -> None:
    """The ``hotcache`` console script: exits 0 on success (main's return value is for tests)."""
    main()
