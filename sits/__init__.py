"""SITS: a serverless runtime for LLM inference.

Layers (a lower one never imports a higher one): ``sits.engine`` runs one model on one device;
``sits.bench`` measures it; ``sits.cli`` is the ``sits`` command.
"""

__version__ = "0.1.0"
