"""`hotcache` console script: LightningCLI for any CTR model and datamodule.

    hotcache fit -c configs/dlrm_synthetic.yaml
    hotcache fit --model models.DeepFM --data datamodules.SyntheticCTRDataModule --trainer.max_epochs 1
    hotcache profile -c configs/dlrm_synthetic.yaml --out stats.npz --plot coverage.png
    hotcache plan -c configs/dlrm_synthetic.yaml --budget 2GB [--stats stats.npz] [--out plan.json] [--world-size 8]
    hotcache predict -c configs/dlrm_synthetic.yaml --ckpt_path last   # scores into predictions.csv
    hotcache consolidate checkpoints/run/last.ckpt --out plain.ckpt   # from checkpoint_shards=True

Model and data are given by class path (subclass mode), so user subclasses work too. The
datamodule's ``tables`` and ``num_dense_features`` are linked into the model, so a config
never repeats table sizes. After ``fit`` the final validation metrics are printed as a
table, with the data's Bayes-optimal figures beside them when it knows them. ``predict``
writes its scores to ``predictions.csv`` in the trainer's root folder unless a prediction
writer is configured (`lightning_hotcache.PredictionWriter` takes another path or format).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import warnings
from importlib import import_module
from pathlib import Path
from typing import Any, Sequence

import torch
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, LightningArgumentParser
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from lightning_hotcache._compat import has_last_checkpoint


class HotCacheCLI(LightningCLI):
    """LightningCLI with the datamodule's table shapes linked into the model."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.tables", "model.init_args.tables", apply_on="instantiate")
        parser.link_arguments("data.num_dense_features", "model.init_args.num_dense_features", apply_on="instantiate")

    @override
    def before_instantiate_classes(self) -> None:
        # `--trainer.strategy=pkg.SomeStrategy` with no init_args parses as a plain string, which
        # Lightning lower-cases and looks up as a registry name; build that class with its defaults.
        trainer = self._get(self.config, "trainer")
        strategy = trainer.get("strategy")
        if isinstance(strategy, str) and "." in strategy and strategy.lower() not in StrategyRegistry:
            _check_strategy_class_path(strategy)
            trainer["strategy"] = Namespace(class_path=strategy, init_args=Namespace())
        elif isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
            # Lightning's own message lists a few of its names, none of ours.
            raise ValueError(
                f"--trainer.strategy={strategy} is not a registered strategy name; the names are auto, "
                f"{', '.join(StrategyRegistry.available_strategies())}, or give a Strategy's class path."
            )
        elif isinstance(strategy, Namespace):
            _check_strategy_settings(strategy)

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if cause is error:
                raise
            # jsonargparse wraps an error raised in a model's or datamodule's constructor in
            # errors that repeat every argument, the linked tables included (~20 KB).
            raise cause from None

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

    def _check_last_checkpoint_exists(self) -> None:
        # Lightning takes `--ckpt_path last` with no last checkpoint as no checkpoint at all:
        # it would evaluate the untrained model, with only a warning.
        if self.config_init[self.subcommand].get("ckpt_path") != "last":
            return
        callbacks = [c for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        # The search Lightning makes for "last" (last*.ckpt in each callback's folder).
        if not any(has_last_checkpoint(c, self.trainer) for c in callbacks):
            folders = ", ".join(str(c.dirpath) for c in callbacks) or "none (the config has no ModelCheckpoint)"
            raise FileNotFoundError(
                f"--ckpt_path last: no last checkpoint in {folders}. Train first (`hotcache fit` with the same "
                "config and a ModelCheckpoint with save_last: true), or pass a checkpoint file."
            )

    before_validate = before_test = _check_last_checkpoint_exists

    def before_predict(self) -> None:
        self._check_last_checkpoint_exists()
        # LightningCLI returns `predict`'s predictions to nobody: without a writer of the user's,
        # the scores go to a file in the run's folder.
        if not any(isinstance(c, BasePredictionWriter) for c in self.trainer.callbacks):
            from lightning_hotcache.callbacks.predictions import DEFAULT_PATH, PredictionWriter

            path = Path(self.trainer.default_root_dir) / DEFAULT_PATH
            self.trainer.callbacks.append(PredictionWriter(path))


def _check_strategy_class_path(class_path: str) -> type[Strategy]:
    """The Strategy subclass ``class_path`` names, or an error listing what may be given."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name, None)
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(
            f"--trainer.strategy={class_path} is neither a registered strategy name "
            f"({', '.join(StrategyRegistry.available_strategies())}) nor the class path of a Strategy subclass."
        )
    return cls


def _check_strategy_settings(strategy: Namespace) -> None:
    """Build the configured strategy once, to report a bad setting with the strategy's own message:
    jsonargparse would try the next type of ``Trainer(strategy: str | Strategy)`` and report only
    that the settings are not a string."""
    strategy_class = _check_strategy_class_path(strategy.class_path)
    settings = (strategy.get("init_args") or Namespace()).as_dict()
    if any(isinstance(value, dict) for value in settings.values()):
        return  # nested class settings (a cluster environment, ...): jsonargparse builds those
    try:
        strategy_class(**settings)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"--trainer.strategy ({strategy.class_path}): {error}") from None


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


# What `hotcache profile` and `hotcache plan` do (their parsers' descriptions, and `hotcache --help`'s).
_TOOLS = {
    "profile": "Count row accesses of the training data; save them as .npz.",
    "plan": "Print (and save) the hot/cold plan for a device budget.",
}


def _tool_parser(command: str) -> argparse.ArgumentParser:
    from lightning_hotcache.cache import CACHE_POLICIES  # here: `hotcache --help` imports no cache

    parser = argparse.ArgumentParser(
        prog=f"hotcache {command}",
        description=f"{_TOOLS[command]} Model and data come from a LightningCLI config (-c) plus any --model/--data/--trainer overrides.",
    )
    parser.add_argument("--batches", type=int, default=200, help="training batches to profile (default 200)")
    if command == "profile":
        parser.add_argument("--out", required=True, help="where to write the stats (.npz)")
        parser.add_argument("--plot", help="also save the coverage curves as an image (e.g. coverage.png)")
    else:
        parser.epilog = (
            "Options left out are the run's: the config's hotcache strategy settings (else the strategy's "
            "defaults), and the trainer's world size and device."
        )
        parser.add_argument("--budget", help="bytes, '2GB', a fraction in (0, 1] of the tables, or 'auto'")
        parser.add_argument("--stats", help="access stats from `hotcache profile` (profiled on the fly if none)")
        parser.add_argument("--out", help="save the plan as JSON; train with it: --trainer.strategy.init_args.plan_path")
        parser.add_argument("--prefetch-depth", type=int)
        parser.add_argument("--prefetch-thread", action=argparse.BooleanOptionalAction)
        parser.add_argument(
            "--world-size", type=int, help="processes of the run; above 1 also prints each rank's bytes and modelled traffic"
        )
        parser.add_argument("--policy", choices=list(CACHE_POLICIES))
        parser.add_argument("--device")
    return parser


def _profile(cli: HotCacheCLI, tables: list, batches: int) -> Any:
    from lightning_hotcache.planner.profiling import profile_batches

    cli.datamodule.setup("fit")
    return profile_batches(cli.datamodule.train_dataloader(), tables, max_batches=batches)


def _run_batch_size(cli: HotCacheCLI) -> int | None:
    from lightning_hotcache.planner.profiling import run_batch_size

    cli.datamodule.setup("fit")
    return run_batch_size(cli.datamodule.train_dataloader())


def _dense_parameter_count(model: Any) -> int:
    """Parameters outside the embedding tables (what DDP all-reduces)."""
    from torchrec import EmbeddingBagCollection

    tables = {id(p) for m in model.modules() if isinstance(m, EmbeddingBagCollection) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in tables and p.requires_grad)


def _given(option: Any, default: Any) -> Any:
    return default if option is None else option


def run_tool(command: str, argv: Sequence[str]) -> Any:
    """``hotcache profile`` / ``hotcache plan``: model and data from the config, no training."""
    from lightning_hotcache.cache.lookahead import default_lookahead_batches
    from lightning_hotcache.planner.plan import HotColdPlanner, StatsNeededError, staging_choice, tables_bytes
    from lightning_hotcache.checkpoint.files import check_output_file
    from lightning_hotcache.planner.profiling import AccessStats, plot_coverage
    from lightning_hotcache.optim.rowwise import RowWiseOptimizerConfig
    from lightning_hotcache.strategies.hotcache import HotCacheStrategy

    parser = _tool_parser(command)
    options, rest = parser.parse_known_args(argv)
    if options.batches < 1:
        parser.error(f"--batches must be >= 1, got {options.batches}")
    for option in ("out", "plot"):
        target = getattr(options, option, None)
        # Checked now: these files are written after profiling, which can take minutes.
        if target is not None:
            try:
                check_output_file(target, {"out": "stats" if command == "profile" else "plan", "plot": "plot"}[option])
            except (OSError, ValueError) as error:
                parser.error(f"--{option}: {error}")
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
    # What the run will hold: the config's hotcache strategy settings unless given here.
    strategy = cli.trainer.strategy
    run = strategy if isinstance(strategy, HotCacheStrategy) else HotCacheStrategy()
    stats_path = options.stats or run.stats_path
    stats = AccessStats.load(stats_path, tables) if stats_path else None
    optimizer = getattr(cli.model, "embedding_optimizer_config", None) or RowWiseOptimizerConfig()
    policy = _given(options.policy, run.cache_policy)
    # The run's batch size, read once: stats must have been made with it, and the lookahead
    # window's default depends on it (`default_lookahead_batches`).
    default_window = policy == "lookahead" and run.lookahead_batches is None
    run_batch_size = _run_batch_size(cli) if stats is not None or default_window else None
    window = run.lookahead_batches or default_lookahead_batches(run_batch_size)
    device = _given(options.device, strategy.root_device)
    staging = staging_choice(  # as the run will choose it for these tables
        _given(options.prefetch_thread, run.prefetch_thread), _given(options.prefetch_depth, run.prefetch_depth_setting),
        device, tables_bytes(tables),
    )  # fmt: skip
    planner = HotColdPlanner(
        _given(options.budget, run.device_budget),
        optimizer,
        world_size=_given(options.world_size, cli.trainer.world_size),
        prefetch_depth=staging.depth,
        cache_policy=policy,
        device=device,
        grow_budget_to_minimum=run.grow_budget_to_minimum,
        prefetch_thread=staging.thread,
        lookahead_batches=window,
    )
    try:
        plan = planner.plan(tables, stats, run_batch_size if stats is not None else None)
    except StatsNeededError:
        stats = _profile(cli, tables, options.batches)
        plan = planner.plan(tables, stats)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(plan)
    if plan.world_size > 1:  # what each rank holds and sends needs the access law: profile if the plan did not
        from lightning_hotcache.planner.traffic import per_rank_report

        stats = stats if stats is not None else _profile(cli, tables, options.batches)
        batch_size = run_batch_size or _run_batch_size(cli) or stats.batch_size
        print(per_rank_report(plan, stats, tables, optimizer, batch_size, _dense_parameter_count(cli.model)))
    if options.out:
        plan.save(options.out)
        print(f"saved {options.out}")
    return plan


def _consolidate(argv: Sequence[str]) -> dict[str, Any]:
    from lightning_hotcache.checkpoint.files import consolidate_checkpoint

    options = _consolidate_parser().parse_args(argv)
    checkpoint = consolidate_checkpoint(options.checkpoint, options.out)
    print(f"saved {options.out}")
    return checkpoint


def _consolidate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotcache consolidate",
        description="Turn a checkpoint saved with checkpoint_shards=True into a plain one (whole tables).",
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--out", required=True, help="where to write the plain checkpoint")
    return parser


def _first_sentence(text: str) -> str:
    return text.strip().split("\n")[0].split(". ")[0].rstrip(".")


def _help() -> str:
    """``hotcache --help``: every command with one line (LightningCLI's own help knows only its subcommands)."""
    summaries = {name: inspect.getdoc(getattr(Trainer, name)) or "" for name in HotCacheCLI.subcommands()}
    summaries |= _TOOLS
    summaries["consolidate"] = _consolidate_parser().description or ""
    width = max(map(len, summaries))
    return "\n".join([
        "usage: hotcache COMMAND [options]",
        "",
        "Train CTR models with Lightning and plan their hot/cold embeddings.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {_first_sentence(text)}" for name, text in summaries.items()),
        "",
        "Options of a command: hotcache COMMAND --help. fit, validate, test and predict are",
        "LightningCLI's: a config (-c CONFIG), --trainer/--model/--data overrides, --print_config.",
        "Example: hotcache fit -c configs/dlrm_synthetic.yaml",
    ])  # fmt: skip


def main(args: Any = None) -> Any:
    """Entry point of the ``hotcache`` script (``args`` as for LightningCLI, for tests)."""
    # W&B never reaches the network unless the user asks for it (configs use offline mode too).
    os.environ.setdefault("WANDB_MODE", "offline")
    # `--model mymodule.MyModel` imports from the current directory, as under `python -m`
    # (a console script has only its own folder on sys.path).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["-h"], ["--help"]):
        print(_help())
        raise SystemExit(0)
    if not argv:
        print(f"{_help()}\n\nhotcache: error: give a command.", file=sys.stderr)
        raise SystemExit(2)
    if argv and argv[0] in ("profile", "plan"):
        return run_tool(argv[0], argv[1:])
    if argv and argv[0] == "consolidate":
        return _consolidate(argv[1:])
    return _lightning_cli(args)


def entry_point() -> None:
    """The ``hotcache`` console script: exits 0 on success (main's return value is for tests)."""
    try:
        main()
    finally:
        # Lightning leaves the process group alive after fit; exiting with it alive lets gloo's
        # worker threads outlive the interpreter's finalization, which now and then aborts a
        # finished run at exit (pytorch/pytorch#179291).
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
