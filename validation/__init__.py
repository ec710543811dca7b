"""memplan's accuracy harness: the measured matrices and their records (not installed)."""
