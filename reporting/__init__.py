"""What the report computes from results.json: statistics (intervals, paired differences) and
answer diagnostics."""
