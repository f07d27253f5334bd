"""megatron_rl: the ScaleRL recipe on a Megatron-Core trainer fed by SGLang generators.

Importing the package is cheap: heavy dependencies (torch, megatron-core, SGLang, Ray) are imported by
the subpackages that need them, never here.
"""

__version__ = "0.1.0"
