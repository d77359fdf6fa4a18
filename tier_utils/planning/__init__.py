"""What fits and runs where: the fit planner (`fit`, planner.py) and the device report (`info`, device_report.py)."""
