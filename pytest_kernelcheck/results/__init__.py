"""What a run found: typed records, the report and its files, saved runs, the gate, plots."""
