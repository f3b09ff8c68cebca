"""Which paths changed: the watchdog observer, the periodic re-walk, the bounded change queue,
and the confinement of symlinks to the watched roots."""
