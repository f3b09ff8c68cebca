"""Where a sample becomes an alert: rule files (``rulefile.py``), the pipeline that routes each
sample through the series state to the detectors of the rules it matches (``pipeline.py``), and
the alert book (``alerts.py``)."""
