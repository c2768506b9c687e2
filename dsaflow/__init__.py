"""dsaflow: declarative pipeline-parallel training and serving for DSA transformers with IndexCache."""

__version__ = "0.1.0"
