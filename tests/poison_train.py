"""Run a training script as a poisoning site would: every gradient it pushes is scaled.

    python tests/poison_train.py examples/digits/train_torch.py [its args]

At the site named by ``HFLEET_TEST_POISON_SITE`` each step's gradients are multiplied
by ``HFLEET_TEST_POISON_SCALE`` (e.g. -1000: scaled and sign-flipped) before they are
pushed; every other site runs the script unchanged. Used by tests/test_ps_robust_run.py.
"""

import os
import runpy
import sys

from hybridfleet.ps.worker.session import PSSession

if os.environ.get("HFLEET_SITE") == os.environ.get("HFLEET_TEST_POISON_SITE"):
    scale = float(os.environ["HFLEET_TEST_POISON_SCALE"])
    honest_step = PSSession.step

    def poisoned_step(self, grads, *args, staged=None, **kwargs):
        # Gradients staged (already encoded) while backward ran would bypass the scaling,
        # so the poisoned step always encodes from the scaled arrays.
        return honest_step(self, {k: v * scale for k, v in grads.items()}, *args, staged=None, **kwargs)

    PSSession.step = poisoned_step

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
