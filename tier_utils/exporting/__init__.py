"""`export()` (exporter.py): ONNX or torch.export artifacts with a parity check against eager."""
