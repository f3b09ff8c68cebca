"""The resident agent: wiring and lifecycle (``agent.py``), the worker thread (``worker.py``),
reloads (``reload.py``), the dump side (``dumpflow.py``), systemd notify and process priority."""
