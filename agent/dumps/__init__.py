"""Where a dump becomes a finding: readers per dump layout (msprobe, CANN, Opdebug, MindSpore,
.npy/.npz, torch.save), discovery of dump trees, the one-pass scanner and the first bad op
(``scan.py``), watchpoints on named tensors, and the scan thread the daemon runs (``schedule.py``),
whose typed results go to the pipeline as samples."""
