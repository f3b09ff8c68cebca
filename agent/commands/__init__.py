"""The command line: ``cli.py`` builds the parser and runs ``run``; every one-shot command
(``replay``, ``scan``, ``compare``, ``fusion``, ``rules test``, ``demo``) is a thin front end over
the same stages the daemon runs."""
