"""`hotcache` console script: LightningCLI for any CTR model and datamodule.

    hotcache fit -c configs/dlrm_synthetic.yaml
    hotcache fit --model models.DeepFM --data datamodules.SyntheticCTRDataModule --trainer.max_epochs 1

Model and data are given by class path (subclass mode), so user subclasses work too. The
datamodule's ``tables`` and ``num_dense_features`` are linked into the model, so a config
never repeats table sizes. After ``fit``/``validate``/``test`` the final metrics are printed
as a table, with the data's Bayes-optimal figures beside them when it knows them.
"""

from __future__ import annotations

import os
from typing import Any

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
        self._print_metrics("val")

    def after_validate(self) -> None:
        self._print_metrics("val")

    def after_test(self) -> None:
        self._print_metrics("test")


def main(args: Any = None) -> HotCacheCLI:
    """Entry point of the ``hotcache`` script (``args`` as for LightningCLI, for tests)."""
    # W&B never reaches the network unless the user asks for it (configs use offline mode too).
    os.environ.setdefault("WANDB_MODE", "offline")
    return HotCacheCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
