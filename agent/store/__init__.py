"""The state that survives a restart: SQLite (``state.py``), and the detectors' memory
(``book.py``: which rows changed; ``memory.py``: their codec)."""
