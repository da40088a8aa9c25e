"""What every layer shares, no torch at import: settings, errors, the run folder and its
events, phases, the one record per method, the model's shape, process groups, memory readouts."""
