"""Beside the task but imported by nothing it ships: not shipped."""
