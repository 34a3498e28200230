"""Model quality: test AUC and log loss of every zoo model, as shipped, on MovieLens-100K and synthetic data.

Every model in ``models.MODEL_REGISTRY`` (so models added later are included) trains with its
shipped config for each dataset, ``configs/<name>_movielens.yaml`` and
``configs/<name>_synthetic.yaml``, read by the ``hotcache`` CLI's own LightningCLI: model and
data exactly as shipped (a model without the config of a dataset is skipped there, with a
note). Only the training loop is this script's, the same for every model: at most
``--max-epochs`` epochs, early stopping on val/auc (``--patience``), the checkpoint with the
best val/auc restored, then one ``trainer.test``. Every row stays in memory (strategy
``auto``): the placement strategies learn exactly what ``auto`` learns (tests/test_strategy.py).

Each seed is a run: the seed of the data (MovieLens' random train/val/test split; the
synthetic data's tables, teacher and samples) and of ``seed_everything`` (weights, shuffling).
On synthetic data the teacher's own test AUC (the Bayes-optimal one, ``test/bayes_auc`` from
the datamodule's ``reference_metrics``) is reported beside the model's, with the gap; the
synthetic configs need not ship the same data (``dlrm_synthetic``'s tables are 10x larger),
so compare models there by their gap.

Test-split discipline: the test split is read once per reported figure, by the single
``trainer.test`` of each (model, dataset, seed) run, after training has ended. Everything
tuned is tuned on val AUC only: the early stop, the checkpoint kept, and the shipped configs'
hyperparameters.

Prints a table of mean ± std over the seeds per model and dataset, and writes
benchmarks/results/quality.json (per model, per dataset: every seed's figures, their mean and
std; with machine and settings).

    python benchmarks/quality.py [--models lr deepfm] [--seeds 0 1 2] [--datasets movielens synthetic] [--max-epochs 20]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from report import write_report

from lightning_hotcache.cli import HotCacheCLI
from models import MODEL_REGISTRY

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RESULTS = Path(__file__).parent / "results"
DATASETS = ("movielens", "synthetic")
# Per run: test figures, and the Bayes-optimal AUC where the data knows it.
FIGURES = ("test_auc", "test_logloss", "bayes_auc", "bayes_auc_gap")


def config_path(model: str, dataset: str) -> Path:
    return CONFIGS / f"{model}_{dataset}.yaml"


def load_shipped(config: Path, seed: int, overrides: Sequence[str] = ()) -> tuple[LightningModule, LightningDataModule]:
    """Model and datamodule of a shipped config, built by the CLI (so with its argument links),
    with ``seed`` as the data's seed and the ``seed_everything`` they are built under, and
    ``overrides`` (``key=value`` in LightningCLI's dotted syntax) on top."""
    args = ["-c", str(config), f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
            # The CLI builds a trainer too; this script trains with its own, so keep that one inert.
            "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.strategy=auto",
            *(f"--{override}" for override in overrides)]  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python.*")
        cli = HotCacheCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                          args=args, run=False)  # fmt: skip
    return cli.model, cli.datamodule


def train_and_test(config: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run: fit with early stopping on val/auc, restore the best checkpoint, test once."""
    model, datamodule = load_shipped(config, seed, args.set)
    with tempfile.TemporaryDirectory() as checkpoints:
        best = ModelCheckpoint(dirpath=checkpoints, monitor="val/auc", mode="max", save_top_k=1)
        trainer = Trainer(
            accelerator="auto", devices=1, max_epochs=args.max_epochs, limit_train_batches=args.limit_train_batches,
            callbacks=[EarlyStopping(monitor="val/auc", mode="max", patience=args.patience), best],
            logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(model, datamodule)
        (test,) = trainer.test(model, datamodule, ckpt_path="best", verbose=False)
    run = {
        "seed": seed,
        "test_auc": test["test/auc"],
        "test_logloss": test["test/logloss"],
        "best_val_auc": float(best.best_model_score),
        "epochs": trainer.current_epoch,
    }
    if "test/bayes_auc" in test:
        run["bayes_auc"] = test["test/bayes_auc"]
        run["bayes_auc_gap"] = test["test/bayes_auc"] - test["test/auc"]
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run, and the mean and std (over seeds; None for one seed) of each figure they have."""
    out: dict[str, Any] = {"runs": runs}
    for figure in FIGURES:
        values = [r[figure] for r in runs if figure in r]
        if values:
            std = statistics.stdev(values) if len(values) > 1 else None
            out[figure] = {"mean": statistics.fmean(values), "std": std}
    return out


def _mean_std(summary: dict[str, Any], figure: str) -> str:
    if figure not in summary:
        return "-"
    stats = summary[figure]
    return f"{stats['mean']:.4f} ± {stats['std']:.4f}" if stats["std"] is not None else f"{stats['mean']:.4f}"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    columns = "  ".join(f"{c:<17}" for c in ("test AUC", "test log loss", "Bayes AUC", "gap to Bayes AUC"))
    header = f"{'model':<12}{'dataset':<11}{'seeds':>6}  {columns}"
    print(header)
    print("-" * len(header))
    for model, datasets in results.items():
        for dataset, summary in datasets.items():
            if "skipped" in summary:
                print(f"{model:<12}{dataset:<11}  skipped: {summary['skipped']}")
                continue
            figures = "  ".join(f"{_mean_std(summary, f):<17}" for f in FIGURES)
            print(f"{model:<12}{dataset:<11}{len(summary['runs']):>6}  {figures}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(MODEL_REGISTRY), help="registry names (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one run per seed (default 0 1 2)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument("--patience", type=int, default=2, help="epochs without a better val/auc before stopping")
    parser.add_argument("--limit-train-batches", type=int, help="train batches per epoch, for smoke runs "
                        "(val and test are always read whole)")  # fmt: skip
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for every run, "
                        "for smoke runs, e.g. data.init_args.num_train_samples=2048 (recorded in the settings)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODEL_REGISTRY))
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {sorted(MODEL_REGISTRY)}")
    for option in ("max_epochs", "patience", "limit_train_batches"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1, got {value}")
    return args


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's info lines ("GPU available", "Seed set to", ...) and warnings off, until exit."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (``argv`` as on the command line); returns the report written to ``--out``."""
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    def save_partial(results: dict[str, dict[str, Any]]) -> None:  # a stopped run keeps what it measured
        write_report("quality", args, results, echo=False, device=device, partial=True)

    with quiet_lightning():
        results = run_all(args, save_partial)
    report = write_report("quality", args, results, device=device)
    print()
    print_table(results)
    return report


def run_all(
    args: argparse.Namespace, after_each: Callable[[dict[str, dict[str, Any]]], None] = lambda results: None
) -> dict[str, dict[str, Any]]:
    """Every chosen model on every chosen dataset it has a config for, one run per seed;
    ``after_each`` gets the results so far after each (model, dataset)."""
    results: dict[str, dict[str, Any]] = {}
    for model in args.models:
        results[model] = {}
        for dataset in args.datasets:
            config = config_path(model, dataset)
            if not config.is_file():
                note = f"no {config.relative_to(CONFIGS.parent)}"
                print(f"{model} on {dataset}: skipped, {note}")
                results[model][dataset] = {"skipped": note}
                continue
            runs = []
            for seed in args.seeds:
                runs.append(train_and_test(config, seed, args))
                print(f"{model} on {dataset}, seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in runs[-1].items()
                                                                       if isinstance(v, float)))  # fmt: skip
            results[model][dataset] = {"config": str(config.relative_to(CONFIGS.parent)), **summarize(runs)}
            after_each(results)
    return results


if __name__ == "__main__":
    main()
