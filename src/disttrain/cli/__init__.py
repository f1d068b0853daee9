"""The `disttrain` command line: one small module per verb group, loaded on demand."""
