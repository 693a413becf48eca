"""Helpers of the registry tests: a small saved model, row counts, files under a folder."""

from __future__ import annotations

from pathlib import Path

from hybridfleet.ckpt.run_model import ModelCheckpointer
from hybridfleet.registry import Registry


def save_model(root: Path | str, step: int = 10, framework: str = "torch", seed: int = 0, **metrics: float) -> str:
    """A run-style model checkpoint (a small MLP) of ``framework`` under ``root``; its URL."""
    if framework == "torch":
        import torch

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    else:
        import paddle

        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    ckpt = ModelCheckpointer(str(root), framework, keep_last=5)
    ckpt.final(step, model, metrics)
    return ckpt.store.url


def table_counts(reg: Registry) -> dict[str, int]:
    """Rows per registry table: what a refused operation must leave unchanged."""
    from sqlalchemy import func, select

    from hybridfleet.registry.schema import metadata

    with reg.engine.connect() as conn:
        return {name: conn.execute(select(func.count()).select_from(t)).scalar() for name, t in metadata.tables.items()}


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()
