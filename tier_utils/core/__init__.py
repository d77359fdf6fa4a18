"""The lowest layer: the precision policy, the settings machinery, measurement (timing, load, memory budget),
files and run-folder locks, input checks, errors and their exit codes, progress bars, plot helpers, result rows,
experiment loggers. It imports nothing else of tier_utils."""
