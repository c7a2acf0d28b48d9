"""Test stand-in for Transformer Engine (``transformer_engine``), importable without CUDA.

Put ``tests/te_standin`` on ``sys.path`` to import it (the ``te_standin`` fixture in
``tests/unit/conftest.py`` does). See ``transformer_engine.pytorch`` for what it implements.
"""

__version__ = "2.20.0+standin"
