"""The engine: settings, data, models, training and the runs (its folders are layers,
core at the bottom; tests/test_layout.py). Importing it drops the library notices that
read as failures when nothing failed (engine/core/notices.py)."""

from edgetune.engine.core import notices as _notices

_notices.install()
