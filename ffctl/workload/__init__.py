"""The built-in workload: a small decoder-only GPT trained data-parallel with the recovery API."""
