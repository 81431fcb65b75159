"""Chapter 2.2's fast checks: the ring in one process, collected before every multi-rank test (this folder
sorts first), so a wrong chunk index fails in seconds."""
