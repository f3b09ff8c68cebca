"""Where a log line becomes a sample: following files (``following.py``), tailing one file
through rotation and truncation (``tailer.py``), one parser per producer (``parsers/``), and the
run each file belongs to (``runs.py``)."""
