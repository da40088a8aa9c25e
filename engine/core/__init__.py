"""What every layer shares, no torch at import: settings, errors, the run folder and its
events, phases, the one record per method, process groups, memory readouts."""
