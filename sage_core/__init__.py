"""SAGE Studio: self-hint aligned GRPO on TRL."""

__version__ = "0.1.0"
