"""Finished shards → trainer data: ``export`` (SpecForge, speculators, Parquet) and ``vocab-map``.

``source`` reads a finished run directory with verify's own per-record checks, ``rows`` turns records into
training rows (loss masks, turn merging, length limits), ``formats`` writes them, ``vocab`` builds draft
vocabulary maps. Optional dependencies (numpy, torch, pyarrow, datasets) are imported lazily
(:mod:`eagle_datagen.export.deps`). See docs/export.md.
"""
