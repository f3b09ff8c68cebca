"""Rule files shipped with precision-agent (YAML data; this file only makes them installable)."""
