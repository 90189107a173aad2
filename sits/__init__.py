"""SITS: a serverless runtime for LLM inference.

Layers (a lower one never imports a higher one): ``sits.engine`` runs one model on one device;
``sits.runtime`` runs units on instance processes (zygote, pools, autoscaler, gateway);
``sits.api`` is the HTTP surface; ``sits.bench`` measures; ``sits.cli`` is the ``sits`` command.
"""

__version__ = "0.1.0"
