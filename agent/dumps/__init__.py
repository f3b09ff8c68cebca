"""Tensor-dump readers and the one-pass statistics scanner (work in progress: not yet wired
into the daemon; see the dump-scanning issue)."""
