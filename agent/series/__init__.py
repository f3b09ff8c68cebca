"""Per-series state between the readers and the detectors: logical facts out of raw records
(rank copies counted once, back-offs as overflow events, loss scaling, attempts)."""
