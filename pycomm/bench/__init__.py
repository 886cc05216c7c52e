"""The benchmark runner behind ``python -m pycomm.bench``."""
