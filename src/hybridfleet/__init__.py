"""hybridfleet: deep-learning training from a laptop to a private cluster and the cloud.

Importing this package never imports torch or paddle; the framework adapters
(`hybridfleet.torch`, `hybridfleet.paddle`) do so when they are imported.
"""

__version__ = "0.1.0"
