"""The command-line flags of the charlm training scripts, the same for torch and paddle.

Sizes of the model (``--layers --d-model --heads --context``), of the optimizer and
schedule, and of the held-out evaluation. Steps, batch size and seed come from the job's
``train:`` section.
"""

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of ``train_torch.py`` / ``train_paddle.py`` (defaults: the 4-layer, d_model 256, context 128 model)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at this fraction of --lr")
    parser.add_argument("--test-bytes", type=int, default=65536, help="bytes of held-out text the bpc is measured on")
    return parser.parse_args(argv)
