"""Privacy mechanisms for what a site sends: differential privacy (clipping + Gaussian noise
with an accountant). See docs/PRIVACY.md for what each protects and what it does not."""

from hybridfleet.privacy.dp import GaussianMechanism, budgeted_steps, epsilon_spent, steps_within_budget

__all__ = ["GaussianMechanism", "budgeted_steps", "epsilon_spent", "steps_within_budget"]
