"""precision-agent: a resident monitor for numerical-precision failures in training jobs."""

__version__ = "0.1.0"
