"""A local package mytask imports: shipped whole (every .py under blocks/)."""
